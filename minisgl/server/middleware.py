"""The checks every request passes before any route sees it: the API key and the body size limit; and, with
--enable-request-id-headers, the request id every response carries.

Plain ASGI on purpose: Starlette's BaseHTTPMiddleware wraps `receive` and hides client disconnects
from the endpoints, and it reads bodies in full before anyone could refuse them.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.server.errors import ApiError, error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})  # what probes and scrapers call; they carry no key


class ApiKeyCheck:
    """401 unless `Authorization: Bearer KEY`, on every path but OPEN_PATHS (the key is compared in
    constant time, so response timing does not reveal how much of a guess was right). A WebSocket without
    the key is refused in its handshake (the server answers it 403)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and get_route_path(scope) not in OPEN_PATHS and \
                not self.authorized(scope):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            error = ApiError(401, "invalid or missing API key", code="invalid_api_key")
            return await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class BodySizeLimit:
    """413 for a body over `limit` bytes: at once from Content-Length, before any of the body is read;
    for a chunked body, as soon as what arrived passes the limit (the rest is never read)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await error_response(self.too_large())(scope, receive, send)
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # raised inside the route's body read: answered by the error handlers
                raise self.too_large()
            return message

        await self.app(scope, counted_receive, send)

    def too_large(self) -> ApiError:
        # Starts with the status's reason phrase, which SGLang's clients look for.
        return ApiError(413, f"Payload Too Large: the request body is larger than {self.limit} bytes "
                             f"(--max-request-bytes)", code="request_too_large")


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every response carries `X-Request-Id`, the request's own (a client or
    a proxy sent it) or a new one (32 hex digits), so that logs on both sides can be matched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
