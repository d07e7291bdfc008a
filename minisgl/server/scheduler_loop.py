"""A scheduler process of the server: rank 0 talks ZMQ, ranks 1..N-1 follow its broadcast."""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from minisgl.engine.config import EngineArgs
from minisgl.messages import Ready, ReqOutput, StatsReply, StatsRequest
from minisgl.scheduler import Scheduler
from minisgl.scheduler.rank import build_scheduler, follow
from minisgl.server.ipc import IpcPaths, become_child, freeze_startup_heap, inbox, outbox

logger = logging.getLogger("minisgl.scheduler")

IDLE_POLL_MS = 50  # how long an idle rank 0 waits for messages before looping (and re-broadcasting)
GRAMMAR_POLL_MS = 2  # ... while a grammar compiles: its request starts as soon as it is done


def run_scheduler(rank: int, size: int, port: int, args: EngineArgs, ipc: IpcPaths, log_level: str) -> None:
    become_child()
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    start = time.perf_counter()
    scheduler = build_scheduler(rank, size, port, args)
    engine = scheduler.engine
    graphs = engine.graphs
    logger.info("engine built in %.1f s: weights and KV pool %.1f s, CUDA graphs %s", time.perf_counter() - start,
                engine.load_seconds, f"{graphs.capture_seconds:.1f} s ({graphs.memory_bytes / 2**20:.0f} MiB)"
                if graphs else "off")
    freeze_startup_heap()
    if rank == 0:
        SchedulerServer(scheduler, ipc).run()
        engine.close()
    else:
        follow(scheduler)


class SchedulerServer:
    def __init__(self, scheduler: Scheduler, ipc: IpcPaths):
        self.scheduler = scheduler
        ctx = zmq.Context()
        self.inbox = inbox(ctx, ipc.scheduler)
        self.to_detok = outbox(ctx, ipc.detokenizer)
        self.to_api = outbox(ctx, ipc.api)
        self.sent: dict[int, int] = {}  # rid -> output tokens already reported
        self.generated = 0  # tokens reported since the last stats reply, for gen_throughput
        self.last_stats = time.monotonic()
        self.step_tokens: Counter[int] = Counter()  # steps since the last stats reply, by their token count
        self.scheduled_at: dict[int, float] = {}  # rid -> when it was first seen scheduled, until its first output

    def run(self) -> None:
        start = time.perf_counter()
        self.scheduler.warm_up()
        logger.info("warm-up %.1f s", time.perf_counter() - start)
        engine = self.scheduler.engine
        self.to_api.send_pyobj(Ready("scheduler", {
            "max_seq_len": engine.max_seq_len, "num_pages": engine.num_pages, "page_size": engine.page_size,
            "kv_capacity_tokens": engine.num_pages * engine.page_size, "vocab_size": engine.config.vocab_size,
            "dtype": str(engine.config.dtype).replace("torch.", ""), "device": str(engine.device),
            "tp_size": self.scheduler.tp.size, "model_path": str(engine.model_path)}))
        while not self.scheduler.shutdown:
            messages = self.receive(block=not self.scheduler.can_step)
            asks = [m for m in messages if isinstance(m, StatsRequest)]
            before = time.monotonic()
            self.scheduler.tick([m for m in messages if not isinstance(m, StatsRequest)])
            self.note_step(before)
            self.report()
            for ask in asks:
                self.to_api.send_pyobj(StatsReply(ask.ask_id, self.stats()))

    def receive(self, block: bool) -> list:
        if block and not self.inbox.poll(GRAMMAR_POLL_MS if self.scheduler.compiling else IDLE_POLL_MS):
            return []
        messages = []
        while True:
            try:
                messages.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def note_step(self, began: float) -> None:
        """Count the tick's step by its tokens (vLLM's iteration tokens) and stamp the requests it scheduled
        for the first time with the tick's start (their queue time ends there)."""
        if self.scheduler.last_step_tokens:
            self.step_tokens[self.scheduler.last_step_tokens] += 1
        for req in self.scheduler.running:
            self.scheduled_at.setdefault(req.rid, began)
        for req in self.scheduler.finished:  # scheduled and finished within this tick
            if req.output_ids:
                self.scheduled_at.setdefault(req.rid, began)

    def report(self) -> None:
        """Send every request's new tokens (and finish) of the last step to the detokenizer."""
        outputs = []
        progressed, finished = self.scheduler.take_outputs()
        for req in progressed + finished:
            start = self.sent.pop(req.rid, 0)
            if req.finish_reason is None:
                self.sent[req.rid] = len(req.output_ids)
            self.generated += len(req.output_ids) - start
            scored = req.prompt_logprobs if start == 0 and req.params.prompt_logprobs is not None else None
            scheduled = self.scheduled_at.pop(req.rid, None) if start == 0 else None
            outputs.append(ReqOutput(req.rid, req.output_ids[start:], req.output_logprobs[start:], req.finish_reason,
                                     len(req.prompt_ids), req.cached_tokens, req.error, scored, scheduled,
                                     req.hidden_state))
        if outputs:
            if self.scheduler.trace is not None:
                self.scheduler.trace.sent()
            self.to_detok.send_pyobj(outputs)

    def stats(self) -> dict:
        now = time.monotonic()
        throughput = self.generated / max(now - self.last_stats, 1e-6)
        steps, self.step_tokens = dict(self.step_tokens), Counter()
        self.generated, self.last_stats = 0, now
        return {**self.scheduler.stats(), "gen_throughput": throughput, "step_tokens": steps}
