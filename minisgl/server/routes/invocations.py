"""POST /invocations: one route for a chat or a text completion, told apart by the body (`messages` or
`prompt`), as vLLM serves it for hosts that call a single path (Amazon SageMaker). The answer, streamed or
not, is exactly that of /v1/chat/completions or /v1/completions."""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from minisgl.server.errors import ApiError


def invocations_router(routes: dict[str, tuple[type[BaseModel], Callable[..., Awaitable[Response]]]]) -> APIRouter:
    """The /invocations route over `routes`: the body field that tells a request apart (`messages`, `prompt`)
    -> the request schema and the route that answers it (api.py hands chat's and completions')."""
    router = APIRouter()

    # Out of openapi.json: its body and answers are those of the two routes (documented there), and a schema
    # that is one of two large request schemas only slows schema-driven clients and fuzzers down.
    @router.post("/invocations", response_model=None, include_in_schema=False)
    async def invocations(request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from None
        kinds = [field for field in routes if isinstance(payload, dict) and field in payload]
        if len(kinds) != 1:
            raise ApiError(400, "the body must be a chat request (with `messages`) or a completion request (with "
                                "`prompt`), not both")
        schema, route = routes[kinds[0]]
        try:
            body = schema.model_validate(payload)
        except ValidationError as exc:  # answered as the two routes answer a bad body
            raise RequestValidationError(exc.errors()) from None
        return await route(body, request, request.app.state.server)

    return router
