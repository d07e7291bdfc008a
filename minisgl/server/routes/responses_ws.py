"""The Responses API's WebSocket mode (OpenAI's transport for long tool-calling chains): a persistent
connection to `/v1/responses` on which each `response.create` event runs one response, streamed back as
the same named events as `POST /v1/responses` with `stream: true`, one response at a time.

A `response.create` is the create body (without `stream` and `background`) and `generate: false` (a
warm-up: the response is made and kept, with no output, for the next turn to continue). The connection
keeps its last response, so `previous_response_id` naming it works even with `store: false`; any other id
is looked up in the store. A problem with one event is an `error` event (`invalid_json`,
`unknown_event_type`, `previous_response_not_found`, or the request's own error) and the connection stays
open for the next.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from minisgl.server.errors import ApiError, invalid_request
from minisgl.server.responses_store import ResponseStore, Stored
from minisgl.server.routes.responses import ResponsesRequest, begin, events, head_of
from minisgl.server.state import ServerState

router = APIRouter()


class Connection:
    """One socket's turns: its last response is kept for the next turn to continue."""

    def __init__(self, socket: WebSocket, state: ServerState, store: ResponseStore):
        self.socket, self.state, self.store = socket, state, store
        self.last: Stored | None = None

    async def error(self, status_code: int, code: str, message: str, param: str | None = None) -> None:
        await self.socket.send_text(json.dumps({"type": "error", "status": status_code, "error": {
            "type": "invalid_request_error" if status_code < 500 else "server_error", "code": code,
            "message": message, "param": param}}))

    async def turn(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError as exc:
            return await self.error(400, "invalid_json", f"the message is not JSON: {exc}")
        kind = event.get("type") if isinstance(event, dict) else None
        if kind != "response.create":
            return await self.error(400, "unknown_event_type", f"unknown event type {str(kind)[:100]!r}; "
                                                               f"this server takes 'response.create'", "type")
        fields = {key: value for key, value in event.items() if key not in ("type", "generate")}
        for transport in ("stream", "background"):
            if transport in fields:
                return await self.error(400, "invalid_request_error", f"{transport} is not used in WebSocket "
                                                                      f"mode", transport)
        generate = event.get("generate", True)
        if not isinstance(generate, bool):
            return await self.error(400, "invalid_request_error", "generate must be true or false", "generate")
        try:
            await self.create(ResponsesRequest.model_validate(fields | {"stream": True}), generate)
        except (ValidationError, ApiError) as exc:
            error = invalid_request(exc.errors()) if isinstance(exc, ValidationError) else exc
            await self.error(error.status, error.code or "invalid_request_error", error.message, error.param)

    def previous(self, response_id: str) -> Stored:
        if self.last is not None and self.last.response.id == response_id:
            return self.last
        return self.store.previous(response_id)

    async def create(self, body: ResponsesRequest, generate: bool) -> None:
        history = self.previous(body.previous_response_id).messages if body.previous_response_id else []
        if not generate:
            return await self.warm_up(body, history)
        run = await begin(self.state, body, history)

        def keep(entry: Stored) -> None:
            self.last = entry
            if body.stored:
                self.store.put(entry)

        async for event in events(self.state, run, keep):
            await self.socket.send_text(json.dumps(event))

    async def warm_up(self, body: ResponsesRequest, history: list[dict]) -> None:
        """generate: false: a completed response with no output, holding the conversation so far."""
        body.as_chat(history)  # the request is checked as a generating one would be
        head = head_of(body, self.state.args.served_model_name)
        head.status = "completed"
        self.last = Stored(head, history + body.turns(), body.listed_input())
        if body.stored:
            self.store.put(self.last)
        for number, kind in enumerate(("response.created", "response.completed")):
            await self.socket.send_text(json.dumps({"type": kind, "sequence_number": number,
                                                    "response": head.model_dump(mode="json")}))


@router.websocket("/v1/responses")
async def responses_socket(socket: WebSocket) -> None:
    await socket.accept()  # with --api-key, the key middleware has checked the handshake
    connection = Connection(socket, socket.app.state.server, socket.app.state.responses)
    try:
        while True:
            await connection.turn(await socket.receive_text())
    except WebSocketDisconnect:
        pass
