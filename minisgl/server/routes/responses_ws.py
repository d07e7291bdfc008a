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
from minisgl.server.pipeline import start
from minisgl.server.responses_store import ResponseStore, Stored
from minisgl.server.responses_turn import ResponsesAnswer, head_of, responses_plan, responses_tool_use
from minisgl.server.schemas.responses import ResponsesRequest
from minisgl.server.sse import ending_in_failure
from minisgl.server.state import ServerState

router = APIRouter()


class Connection:
    """One socket's turns: its last response is kept for the next turn to continue."""

    def __init__(self, socket: WebSocket, state: ServerState, store: ResponseStore):
        self.socket, self.state, self.store = socket, state, store
        self.last: Stored | None = None

    async def error(self, error: ApiError) -> None:
        await self.socket.send_text(json.dumps({"type": "error", "status": error.status, **error.body()}))

    async def turn(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError as exc:
            return await self.error(ApiError(400, f"the message is not JSON: {exc}", code="invalid_json"))
        kind = event.get("type") if isinstance(event, dict) else None
        if kind != "response.create":
            return await self.error(ApiError(400, f"unknown event type {str(kind)[:100]!r}; this server takes "
                                                  f"'response.create'", param="type", code="unknown_event_type"))
        fields = {key: value for key, value in event.items() if key not in ("type", "generate")}
        for transport in ("stream", "background"):
            if transport in fields:
                return await self.error(ApiError(400, f"{transport} is not used in WebSocket mode", param=transport))
        generate = event.get("generate", True)
        if not isinstance(generate, bool):
            return await self.error(ApiError(400, "generate must be true or false", param="generate"))
        try:
            await self.create(ResponsesRequest.model_validate(fields | {"stream": True}), generate)
        except ValidationError as exc:
            await self.error(invalid_request(exc.errors()))
        except ApiError as exc:
            await self.error(exc)

    def previous(self, response_id: str) -> Stored:
        if self.last is not None and self.last.response.id == response_id:
            return self.last
        return self.store.previous(response_id)

    def keep(self, entry: Stored, stored: bool) -> None:
        self.last = entry
        if stored:
            self.store.put(entry)

    async def create(self, body: ResponsesRequest, generate: bool) -> None:
        history = self.previous(body.previous_response_id).messages if body.previous_response_id else []
        use = responses_tool_use(body, self.state.args.tool_call_parser)
        plan = responses_plan(body, history, use)  # a warm-up is checked as a generating turn is
        if not generate:
            return await self.warm_up(body, history)
        answer = ResponsesAnswer(body, history, plan, use, self.state, self.store,
                                 lambda entry: self.keep(entry, body.stored))
        checked, choices = await start(self.state, plan)
        async for event in ending_in_failure(answer.stream(checked, choices), answer.failed):
            await self.socket.send_text(json.dumps(event))

    async def warm_up(self, body: ResponsesRequest, history: list[dict]) -> None:
        """generate: false: a completed response with no output, holding the conversation so far."""
        head = head_of(body, self.state.args.served_model_name)
        head.status = "completed"
        self.keep(Stored(head, history + body.turns(), body.listed_input()), body.stored)
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
