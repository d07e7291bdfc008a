"""A streamed answer's events, ended the way its protocol says even when the generation fails, and their two
server-sent-event framings: `data:` lines ending in `data: [DONE]` (chat, completions, /generate) and named
`event:` lines (Responses). Once a stream has started its status cannot change any more: a failure is its last
event, built by the stream's `failed` from the one error builder (errors.failure)."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

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


def event_stream(events: AsyncIterator[Event], failed: Callable[[ApiError], Event], named: bool,
                 headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events: named (`event: <type>`), or `data:` lines closed by `data: [DONE]`."""
    async def frames() -> AsyncIterator[str]:
        async for event in ending_in_failure(events, failed):
            payload = json.dumps(event) if isinstance(event, dict) else event.model_dump_json()
            yield f"event: {event['type']}\ndata: {payload}\n\n" if named else f"data: {payload}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)
