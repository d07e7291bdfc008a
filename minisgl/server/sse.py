"""A streamed answer's events, ended the way its protocol says even when the generation fails, and their two
server-sent-event framings: `data:` lines ending in `data: [DONE]` (chat, completions, /generate) and named
`event:` lines (Responses). Once a stream has started its status cannot change any more: a failure is its last
event, built by the stream's `failed` from the one error builder (errors.failure)."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from minisgl.server.errors import ApiError, failure

Event = BaseModel | dict  # a chunk (data: framing) or a named event, {"type": name, ...} (event: framing)


async def ending_in_failure(events: AsyncIterator[Event], failed: Callable[[ApiError], Event]
                            ) -> AsyncIterator[Event]:
    """The events, then, if the generation fails (a failed sequence, or a bug: the stream must still end as
    the protocol says, not be cut), the event `failed` makes of its error."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield failed(failure(exc))


class EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse, stopped the same way when the client hangs up (the stream is cancelled:
    its sequences are aborted), without an anyio task group and cancel scope per request: those cost ~40 us of
    the event loop per stream on this server's CPU (a burst of arrivals holds every running stream's next chunk
    for the sum). `ending` goes out with the end of the body, in one write (`data: [DONE]`). HTTP only, no
    background task."""

    def __init__(self, content: AsyncIterator[str], ending: bytes, headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.ending = ending

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": self.ending, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def hung_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming, listening = asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            streaming.cancel()  # the client left, or this request is cancelled: the stream's cleanup runs first
            await asyncio.wait((streaming,))
        if not streaming.cancelled():
            streaming.result()  # what the stream raised, if anything


def event_stream(events: AsyncIterator[Event], failed: Callable[[ApiError], Event], named: bool,
                 headers: dict[str, str] | None = None) -> EventStreamResponse:
    """Server-sent events: named (`event: <type>`), or `data:` lines closed by `data: [DONE]`."""
    async def frames() -> AsyncIterator[str]:
        async for event in ending_in_failure(events, failed):
            payload = json.dumps(event) if isinstance(event, dict) else event.model_dump_json()
            yield f"event: {event['type']}\ndata: {payload}\n\n" if named else f"data: {payload}\n\n"

    return EventStreamResponse(frames(), b"" if named else b"data: [DONE]\n\n", headers)
