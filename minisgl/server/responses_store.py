"""The Responses API's store: responses kept by id for `GET /v1/responses/{id}`, `previous_response_id`,
`input_items` and background runs, in memory and bounded.

At most `capacity` responses are kept; past that the least recently used finished one is dropped (an id
then answers 404, as an unknown one does). A background response's task is kept beside it while it runs,
so that cancelling or deleting it stops the generation (which frees its KV pages) before the answer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Coroutine

from minisgl.server.errors import ApiError

FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass
class Stored:
    """A response (its object, as returned) with what continuing from it needs: the conversation up to and
    including its output as chat messages (instructions left out: a new request gives its own), and its
    own input items as listed by `input_items`."""

    response: Any  # routes.responses.ResponseObject (not imported: that module imports this one)
    messages: list[dict]
    input_items: list[dict]
    task: asyncio.Task | None = field(default=None, repr=False)


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.running: set[asyncio.Task] = set()  # held here: the event loop keeps only weak references to tasks

    def run_behind(self, entry: Stored, work: Coroutine) -> None:
        """Keep `entry` and run `work` (its generation) as its task, until it ends or is stopped."""
        entry.task = asyncio.create_task(work)
        self.running.add(entry.task)
        entry.task.add_done_callback(self.running.discard)
        self.put(entry)

    def put(self, entry: Stored) -> None:
        self.entries[entry.response.id] = entry
        self.entries.move_to_end(entry.response.id)
        while len(self.entries) > self.capacity:
            oldest = next((key for key, kept in self.entries.items() if kept.response.status in FINISHED),
                          next(iter(self.entries)))
            self.entries.pop(oldest)

    def get(self, response_id: str) -> Stored:
        entry = self.entries.get(response_id)
        if entry is None:
            raise ApiError(404, f"Response with id '{response_id[:200]}' not found.", param="response_id",
                           code="response_not_found")
        self.entries.move_to_end(response_id)
        return entry

    def previous(self, response_id: str) -> Stored:
        """The response a request continues from; an unknown id is the request's error (400, as OpenAI has it)."""
        if response_id not in self.entries:
            raise ApiError(400, f"Previous response with id '{response_id[:200]}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        self.entries.move_to_end(response_id)
        return self.entries[response_id]

    async def cancel(self, response_id: str) -> Stored:
        """Stop a background response that is still running (its generation is aborted before this returns);
        one that already finished is returned as it is. A foreground response cannot be cancelled."""
        entry = self.get(response_id)
        if not entry.response.background:
            raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id")
        if entry.response.status not in FINISHED:
            entry.response.status = "cancelled"
            await stop(entry)
        return entry

    async def delete(self, response_id: str) -> None:
        entry = self.get(response_id)
        await stop(entry)
        self.entries.pop(response_id, None)


async def stop(entry: Stored) -> None:
    if entry.task is not None and not entry.task.done():
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
    entry.task = None
