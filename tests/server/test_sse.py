"""The streaming response at the ASGI interface: what it sends, and that a client hanging up stops the stream."""

from __future__ import annotations

import asyncio

from minisgl.server.errors import ApiError, ErrorResponse
from minisgl.server.sse import event_stream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


def failed(error: ApiError) -> ErrorResponse:
    return error.response_model()


async def run(events, named: bool, hang_up: asyncio.Event) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await event_stream(events, failed, named)(SCOPE, receive, send)
    return sent


def test_data_frames_end_with_done_in_the_last_body_message():
    async def events():
        yield {"a": 1}
        yield {"b": 2}

    sent = asyncio.run(run(events(), False, asyncio.Event()))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [m["body"] for m in sent[1:]] == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


def test_named_events_end_with_an_empty_last_body_message():
    async def events():
        yield {"type": "response.created"}

    sent = asyncio.run(run(events(), True, asyncio.Event()))
    assert [m["body"] for m in sent[1:]] == [b'event: response.created\ndata: {"type": "response.created"}\n\n', b""]
    assert sent[-1]["more_body"] is False


def test_a_failure_is_the_last_event_before_done():
    async def events():
        yield {"a": 1}
        raise ApiError(503, "shutting down")

    bodies = [m["body"] for m in asyncio.run(run(events(), False, asyncio.Event()))[1:]]
    assert bodies[-1] == b"data: [DONE]\n\n" and b"shutting down" in bodies[-2] and b"\"error\"" in bodies[-2]


def test_hanging_up_stops_the_stream_and_runs_its_cleanup():
    cleaned_up = []

    async def main() -> list[dict]:
        hang_up = asyncio.Event()

        async def events():
            try:
                yield {"a": 1}
                hang_up.set()  # the client leaves while the stream waits for its next output
                await asyncio.Event().wait()
            finally:
                cleaned_up.append(True)  # where the pipeline aborts the request's sequences

        return await asyncio.wait_for(run(events(), False, hang_up), 10)

    sent = asyncio.run(main())
    assert cleaned_up == [True]
    assert [m.get("body") for m in sent[1:]] == [b'data: {"a": 1}\n\n']  # no [DONE] to a client that left
