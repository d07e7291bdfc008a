"""The api process's handle on the engine: submit requests, stream their text, abort, ask for stats.

One asyncio task reads the api inbox and routes each message to the request waiting for it. A
request whose consumer goes away (client disconnect, cancellation) is aborted in the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from minisgl.core import Req, SamplingParams
from minisgl.scheduler import AbortReq, AddReq
from minisgl.server.ipc import DetokRegister, IpcPaths, Ready, StatsReply, StatsRequest, TextOutput, inbox, outbox
from minisgl.server.metrics import Metrics

logger = logging.getLogger("minisgl.api")


@dataclass
class Finished:
    """What the api needs once a request ends: for usage, logs and metrics."""

    rid: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft: float | None
    latency: float
    itls: list[float] = field(default_factory=list)


class EngineClient:
    def __init__(self, ipc: IpcPaths, metrics: Metrics):
        ctx = zmq.asyncio.Context()
        self.inbox = inbox(ctx, ipc.api)
        self.to_scheduler = outbox(ctx, ipc.scheduler)
        self.to_detok = outbox(ctx, ipc.detokenizer)
        self.metrics = metrics
        self.ready = asyncio.Event()  # set once the scheduler and the detokenizer both report Ready
        self.components_ready: set[str] = set()
        self.info: dict = {}
        self.streams: dict[int, asyncio.Queue[TextOutput]] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.queued = 0  # submitted, no token yet: what --max-queued-requests limits
        self.in_flight = 0

    async def run(self) -> None:
        """Route every message from the scheduler and detokenizer (runs for the server's lifetime)."""
        while True:
            message = await self.inbox.recv_pyobj()
            if isinstance(message, Ready):
                self.info.update(message.info)
                self.components_ready.add(message.component)
                if self.components_ready == {"scheduler", "detokenizer"}:
                    self.ready.set()
            elif isinstance(message, StatsReply):
                waiter = self.stats_waiters.pop(message.ask_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message.stats)
            else:
                for out in message:
                    queue = self.streams.get(out.rid)
                    if queue is not None:
                        queue.put_nowait(out)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, stop: list[str], seed: int,
                       done: list[Finished]) -> AsyncIterator[TextOutput]:
        """Yield the request's text outputs until it finishes; `done` receives its summary at the end.
        Leaving early (the consumer is cancelled or stops iterating) aborts it in the scheduler."""
        rid = next(self.ids)
        queue: asyncio.Queue[TextOutput] = asyncio.Queue()
        self.streams[rid] = queue
        self.to_detok.send_pyobj(DetokRegister(rid, stop))
        self.to_scheduler.send_pyobj(AddReq(Req(rid, prompt_ids, params, seed)))
        start = last = time.monotonic()
        ttft, itls, tokens, finish, cached = None, [], 0, None, 0
        self.queued += 1
        self.in_flight += 1
        try:
            while finish is None:
                out = await queue.get()
                now = time.monotonic()
                if out.new_ids:
                    if ttft is None:
                        ttft = now - start
                        self.queued -= 1
                    else:
                        itls.append((now - last) / len(out.new_ids))
                    last = now
                tokens += len(out.new_ids)
                finish, cached = out.finish_reason, out.cached_tokens
                yield out
        finally:
            del self.streams[rid]
            self.in_flight -= 1
            if ttft is None:
                self.queued -= 1
            if finish is None:  # the consumer left: free the request's pages now
                self.to_scheduler.send_pyobj(AbortReq(rid))
                finish = "abort"
            summary = Finished(rid, len(prompt_ids), tokens, cached, finish, ttft, time.monotonic() - start, itls)
            done.append(summary)
            self.metrics.observe_finished(summary.prompt_tokens, tokens, cached, ttft, summary.latency, itls, finish)
            logger.info("request %d finished: prompt=%d completion=%d cached=%d ttft=%s latency=%.3fs reason=%s",
                        rid, summary.prompt_tokens, tokens, cached, f"{ttft:.3f}s" if ttft is not None else "-",
                        summary.latency, finish)

    async def stats(self, timeout: float = 5.0) -> dict:
        """Fresh scheduler stats (pages, queues, counters), answered after its current step."""
        ask = next(self.ids)
        waiter = asyncio.get_running_loop().create_future()
        self.stats_waiters[ask] = waiter
        self.to_scheduler.send_pyobj(StatsRequest(ask))
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self.stats_waiters.pop(ask, None)
