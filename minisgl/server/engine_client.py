"""The api process's handle on the engine: submit sequences, stream their text, abort, ask for stats.

One asyncio task (`run`) reads the api inbox and routes each message to the sequence waiting for it. The
router, not the consumer, keeps the books (first token, finish, timings, metrics): a consumer that never
starts or goes away early cannot leave a count behind. A consumer that leaves before its sequence
finished aborts it in the scheduler, whose final "abort" output then closes the books.

Admission (`admit`) counts sequences from the moment a request is accepted, before it is tokenized, so
a burst cannot pass the --max-queued-requests check all at once before any of it is counted.

Streams and arrivals take turns (`streams_first`): the event loop runs the callbacks ready at the start of a
round in order, so a burst of arriving requests (~0.5 ms of work each) would hold the running streams' next
chunks for the whole burst. Each arrival looks at the inbox before its work and, when chunks wait there, routes
them and lets their streams write first; the arrivals then have as long as the streams' turn took. A chunk
waits behind a few arrivals, not a burst, and a burst still gets half of a saturated loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator

import zmq

from minisgl.core import Req, SamplingParams
from minisgl.messages import AbortReq, AddReq, DetokRegister, Ready, StatsReply, StatsRequest, TextOutput
from minisgl.scheduler.trace import MessageTrace
from minisgl.server.errors import ApiError
from minisgl.server.ipc import IpcPaths, inbox, outbox
from minisgl.server.metrics import Metrics

logger = logging.getLogger("minisgl.api")


class RequestFailed(ApiError):
    """The engine could not finish a sequence: a fault isolated to it (500) or the server shutting down
    (503). Its client gets this error; every other request goes on."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(status, message)


class Sequence:
    """One submitted generation (a prompt, one sample of it) and its books."""

    def __init__(self, rid: int, prompt_tokens: int, user: str | None = None):
        self.rid, self.prompt_tokens, self.user = rid, prompt_tokens, user
        self.pending: list[TextOutput | RequestFailed] = []  # routed here, not read by its consumer yet
        self.wake = asyncio.Event()  # set when `pending` grows; shared by the sequences one consumer reads
        self.start = self.last = time.monotonic()
        self.ttft: float | None = None
        self.queued: float | None = None  # arrival to first scheduled (seconds), once the scheduler says
        self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None

    def deliver(self, out: TextOutput | RequestFailed) -> None:
        self.pending.append(out)
        self.wake.set()

    def take(self) -> list[TextOutput | RequestFailed]:
        taken, self.pending = self.pending, []
        return taken

    def record(self, out: TextOutput, now: float) -> float | None:
        """Book one output; its inter-token latency (the gap since the last tokens, per token it carries),
        None for the first tokens or none."""
        itl = None
        if out.scheduled_at is not None:
            self.queued = max(0.0, out.scheduled_at - self.start)
        if out.new_ids:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                itl = (now - self.last) / len(out.new_ids)
            self.last = now
        self.completion_tokens += len(out.new_ids)
        self.cached_tokens = out.cached_tokens
        self.finish_reason = out.finish_reason
        return itl


def merged(outs: list[TextOutput]) -> TextOutput:
    """One sequence's consecutive outputs as one: everything they produced, in order; the last one's state
    (finish, cached tokens, latest hidden state); the first one's once-only fields (prompt logprobs, when it
    was scheduled)."""
    if len(outs) == 1:
        return outs[0]
    return replace(outs[-1], text="".join(o.text for o in outs), new_ids=[i for o in outs for i in o.new_ids],
                   logprobs=[e for o in outs for e in o.logprobs],
                   prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
                   scheduled_at=next((o.scheduled_at for o in outs if o.scheduled_at is not None), None),
                   hidden_state=next((o.hidden_state for o in reversed(outs) if o.hidden_state is not None), None))


class EngineClient:
    def __init__(self, ipc: IpcPaths, metrics: Metrics):
        # The process's one context, never garbage: a context collected in the same cycle as its sockets finds
        # their weak references cleared, closes none of them and blocks in term() for good (tests make and drop
        # many clients in one process).
        ctx = zmq.Context.instance()
        # Plain (blocking-API) sockets, no asyncio wrappers: an asyncio socket's recv or send costs a future, a
        # poller registration and callbacks (~8% of this process's CPU at 256 streams, ~70 us a request), and
        # its recv would be a second reader of the inbox beside `streams_first`'s, able to route a later
        # message before an earlier one. The inbox is read only by `route_waiting`, called when its descriptor
        # wakes the loop (`run`) and by arrivals. No send high-water mark, so a send never blocks the loop:
        # what waits is bounded by admission (--max-queued-requests).
        self.inbox = inbox(ctx, ipc.api)
        self.to_scheduler = outbox(ctx, ipc.scheduler, unbounded=True)
        self.to_detok = outbox(ctx, ipc.detokenizer, unbounded=True)
        self.streams_due = False  # an arrival let woken streams go first; those behind it wait their turn too
        self.arrivals_until = 0.0  # (monotonic) arrivals' turn after the streams': the inbox is not looked at
        self.metrics = metrics
        self.ready = asyncio.Event()  # set once the scheduler and the detokenizer both report Ready
        self.components_ready: set[str] = set()
        self.info: dict = {}
        self.sequences: dict[int, Sequence] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.queued = 0  # admitted sequences without a first token yet: what --max-queued-requests limits
        self.trace = MessageTrace.from_env("api")  # None unless MINISGL_STEP_TRACE is set

    @property
    def open_sequences(self) -> int:
        """Sequences submitted and not finished yet (a request has one per prompt x sample)."""
        return len(self.sequences)

    # ---- admission -------------------------------------------------------------------------------

    def admit(self, sequences: int, limit: int | None) -> bool:
        """Count `sequences` as queued if that keeps the queue within `limit` (None: no limit). No await
        between the check and the count: atomic on the event loop."""
        if limit is not None and self.queued + sequences > limit:
            return False
        self.queued += sequences
        return True

    def release(self, sequences: int) -> None:
        """Admitted sequences that will never be submitted (their request was refused after admission)."""
        self.queued -= sequences

    # ---- sequences -------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, stop: list[str], seed: int,
               user: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Send one admitted sequence to the engine (it stays counted as queued until its first token);
        `user` (the request's end user) goes into its log line; `cache_salt` keeps its prefix cache apart."""
        seq = Sequence(next(self.ids), len(prompt_ids), user)
        self.sequences[seq.rid] = seq
        self.to_detok.send_pyobj(DetokRegister(seq.rid, stop))
        self.to_scheduler.send_pyobj(AddReq(Req(seq.rid, prompt_ids, params, seed, cache_salt=cache_salt)))
        return seq

    async def stream(self, seq: Sequence) -> AsyncIterator[TextOutput]:
        """One sequence's outputs, as `streams` gives them."""
        async with aclosing(self.streams([seq])) as outputs:
            async for _, out in outputs:
                yield out

    async def streams(self, seqs: list[Sequence]) -> AsyncIterator[tuple[Sequence, TextOutput]]:
        """Yield the sequences' outputs until they all finish; raises RequestFailed for the first one the engine
        failed. The consumer wakes once per message from the engine, however many of its sequences it carries,
        and takes each sequence's outputs since its last read merged into one: a consumer that falls behind
        (a slow client, a busy event loop) catches up in one read, not one per engine step. Leaving early
        (cancelled, failed, or iteration stopped) aborts the unfinished sequences in the scheduler."""
        wake, running = asyncio.Event(), list(seqs)
        for seq in seqs:
            seq.wake = wake
            if seq.pending:
                wake.set()
        try:
            while running:
                await wake.wait()
                wake.clear()
                for seq in [s for s in running if s.pending]:
                    outs = seq.take()
                    failed = next((i for i, o in enumerate(outs)
                                   if isinstance(o, RequestFailed) or o.error is not None), None)
                    read = outs if failed is None else outs[:failed]
                    if failed is not None or read[-1].finish_reason is not None:
                        running.remove(seq)
                    if read:
                        yield seq, merged(read)
                    if failed is not None:
                        error = outs[failed]
                        raise error if isinstance(error, RequestFailed) else RequestFailed(error.error)
        finally:
            for seq in running:
                if seq.rid in self.sequences:  # the consumer left: free its pages now
                    self.to_scheduler.send_pyobj(AbortReq(seq.rid))

    def fail_all(self, message: str, status: int) -> None:
        """End every sequence now with an error to its client (shutdown past its timeout). Outputs its client
        has not read yet are dropped: the error is next, so that a stream gets it before the server stops (a
        backlog sent first could outlast the server's grace period and leave the stream cut with no error)."""
        for seq in list(self.sequences.values()):
            self.to_scheduler.send_pyobj(AbortReq(seq.rid))
            seq.finish_reason = "abort"
            self._close(seq)
            seq.take()
            seq.deliver(RequestFailed(message, status))

    # ---- routing ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Route every message from the scheduler and detokenizer for the server's lifetime: whenever the
        inbox's descriptor wakes the loop, everything waiting there is routed at once."""
        loop, fd = asyncio.get_running_loop(), self.inbox.getsockopt(zmq.FD)
        loop.add_reader(fd, self.route_waiting)
        try:
            self.route_waiting()  # what came before the reader was added
            await loop.create_future()  # until cancelled (server shutdown)
        finally:
            loop.remove_reader(fd)

    def route_waiting(self) -> bool:
        """Route every message already in the inbox (all of them: a loop that fell behind the engine catches
        up in one round, each consumer woken once, not once per step); True if any carried outputs. The
        descriptor is edge-triggered: it wakes the loop again only for a message that comes after the inbox
        was read empty, so this always reads until it is. One message that cannot be handled is logged and
        skipped, never the end of routing."""
        outputs = False
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            message = raw
            try:
                message = pickle.loads(raw)
                outputs |= self._route(message)
            except Exception:
                logger.exception("could not route a message from the engine: %r", message)

    async def streams_first(self) -> None:
        """Called by an arriving request before its work: if outputs wait in the inbox, route them and step
        back once so that the streams they woke write their chunks first; arrivals queued behind this one step
        back too until its turn comes (they would otherwise run before those streams). Then arrivals have the
        loop for as long as the streams' turn took before the inbox is looked at again: a fair half each when
        the loop is saturated, where streams-always-first would admit one arrival per engine step (256 of them
        queued would wait seconds for their first token)."""
        while self.streams_due or (time.monotonic() >= self.arrivals_until and self.route_waiting()):
            leading, self.streams_due = not self.streams_due, True
            turn = time.monotonic()
            try:
                await asyncio.sleep(0)  # to the back of the loop's queue, behind the woken streams
            finally:
                if leading:
                    self.streams_due = False
                    now = time.monotonic()
                    self.arrivals_until = now + (now - turn)

    def _route(self, message) -> bool:
        """Route one message; True if it was outputs (consumers woken)."""
        if isinstance(message, Ready):
            self.info.update(message.info)
            self.components_ready.add(message.component)
            if self.components_ready == {"scheduler", "detokenizer"}:
                self.ready.set()
        elif isinstance(message, StatsReply):
            self.metrics.observe_steps(message.stats.pop("step_tokens", {}))  # whoever asked, no step is lost
            waiter = self.stats_waiters.pop(message.ask_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message.stats)
        else:
            now = time.monotonic()
            if self.trace is not None:
                self.trace.record(now, [out.rid for out in message])
            for out in message:
                seq = self.sequences.get(out.rid)
                if seq is None:  # already closed (failed at shutdown); late outputs are dropped
                    continue
                had_token = seq.ttft is not None
                itl = seq.record(out, now)
                if itl is not None:  # as it comes: a stream's hundreds at its end would hold the loop
                    self.metrics.observe_itl(itl)
                if seq.ttft is not None and not had_token:
                    self.queued -= 1
                if out.finish_reason is not None:
                    self._close(seq)
                seq.deliver(out)
            return True
        return False

    def _close(self, seq: Sequence) -> None:
        """The sequence is over: settle its books, metrics and log line."""
        del self.sequences[seq.rid]
        if seq.ttft is None:
            self.queued -= 1
        latency = time.monotonic() - seq.start
        self.metrics.observe_finished(seq.prompt_tokens, seq.completion_tokens, seq.cached_tokens, seq.ttft, latency,
                                      seq.finish_reason, seq.queued)
        logger.info("request %d finished: prompt=%d completion=%d cached=%d ttft=%s latency=%.3fs reason=%s%s",
                    seq.rid, seq.prompt_tokens, seq.completion_tokens, seq.cached_tokens,
                    f"{seq.ttft:.3f}s" if seq.ttft is not None else "-", latency, seq.finish_reason,
                    f" user={seq.user!r}" if seq.user is not None else "")

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
