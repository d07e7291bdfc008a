"""OpenAI-style errors: the one JSON shape every failure is answered with, the handlers that produce it,
and its description in openapi.json.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

400 bad parameters, schema errors, malformed JSON, prompts longer than the context; 401 wrong or missing
API key; 404 unknown model or path; 405 wrong method (with `Allow`); 413 body over --max-request-bytes;
500 a fault in handling one request; 503 (with `Retry-After`) loading, draining or queue full.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match

logger = logging.getLogger("minisgl.api")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "service_unavailable"}
DESCRIPTIONS = {400: "Invalid request (the parameter is named in `param`)", 401: "Missing or wrong API key",
                404: "Unknown model", 413: "Request body larger than --max-request-bytes",
                500: "The server failed while handling this request", 503: "Loading, draining or queue full"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(HTTPException):
    """Raised anywhere in a request's handling; answered as OpenAI-style JSON with `status`. (An
    HTTPException, so that FastAPI passes it through when a middleware raises it while a body is read.)"""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(status, message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after

    def response_model(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.response_model().model_dump()

    def body_json(self) -> str:
        return self.response_model().model_dump_json()


def failure(exc: BaseException) -> ApiError:
    """Any exception a request's handling raised, as the error its client is told: an ApiError (a failed
    sequence is one) as it is, anything else (a bug) logged here and told as a 500. Every error body the server
    sends, on HTTP, as a stream's last event or on a WebSocket, is built from this."""
    if isinstance(exc, ApiError):
        return exc
    logger.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}")


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if err.retry_after:
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(err.body(), err.status, headers=headers or None)


def error_responses(*statuses: int) -> dict:
    """The `responses=` of a route: each status answered with the error schema (for openapi.json)."""
    return {status: {"model": ErrorResponse, "description": DESCRIPTIONS[status]} for status in statuses}


UNKNOWN_FIELD = "unknown parameter: this server does not serve it (it is refused, not ignored)"


def field_path(loc: tuple) -> list[str]:
    """A pydantic error location as request fields: without `body` and the names pydantic gives union
    members (`str`, `list[int]`, `function-after[...]`, model class names), which no request field has."""
    return [str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and (not x[:1].islower() or any(c in x for c in "[-(") or x in {"str", "int", "float",
                                                                                        "bool", "list", "dict"}))]


def invalid_request(errors: Sequence[Any]) -> ApiError:
    """A body the schema refuses, as a 400 naming the first field at fault (a malformed JSON body as such).
    pydantic's error type ends the message and is the code (vLLM's messages carry it too: clients match it)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # loc holds a byte offset, not a field
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"malformed JSON body: {detail}".rstrip(": "))
    where = field_path(tuple(first.get("loc", ())))
    kind = first.get("type")
    reason = UNKNOWN_FIELD if kind == "extra_forbidden" else f"{first.get('msg', 'invalid request')} ({kind})"
    message = f"{'.'.join(where) + ': ' if where else ''}{reason}"
    return ApiError(400, message, param=where[0] if where else None, code=kind)


def allowed_methods(request: Request) -> str:
    """A 405's `Allow`: the methods of every route at this path (`app.state.routes`, api.py keeps them).
    Starlette names only the first such route's, one method where a path's methods are separate routes (GET and
    DELETE /v1/responses/{id})."""
    return ", ".join(sorted({method for route in request.app.state.routes
                             if route.matches(request.scope)[0] is not Match.NONE for method in route.methods or ()}))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(invalid_request(exc.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        headers = {**(exc.headers or {}), "Allow": allowed_methods(request)} if exc.status_code == 405 else exc.headers
        return error_response(ApiError(exc.status_code, str(exc.detail)), headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return error_response(failure(exc))
