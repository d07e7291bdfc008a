"""Continuous batching: admit, build a batch, run the engine, commit tokens, finish, retract.

One instance runs per TP rank. Rank 0 receives the messages and broadcasts them, so every rank
applies the same messages in the same order and takes the same decisions (lists, never sets).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from minisgl.core import Batch, Req, ReqStatus, TokenLogprob
from minisgl.distributed import TPGroup
from minisgl.engine.engine import Engine, StepOutput
from minisgl.kvcache import KVCacheManager, make_prefix_cache

logger = logging.getLogger(__name__)


@dataclass
class AddReq:
    req: Req


@dataclass
class AbortReq:
    rid: int


@dataclass
class Shutdown:
    pass


class Scheduler:
    def __init__(self, engine: Engine, tp: TPGroup):
        args = engine.args
        self.engine, self.tp = engine, tp
        self.max_prefill_tokens = args.max_prefill_tokens
        self.max_running = args.max_running_requests
        self.eos_ids = set(engine.config.eos_token_ids)
        self.kv = KVCacheManager(engine.num_pages, args.page_size, make_prefix_cache(args.cache_type, args.page_size),
                                 engine.page_table)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order: the last one is the cheapest to retract
        self.reqs: dict[int, Req] = {}
        self.finished: list[Req] = []  # finished since the caller last drained it
        self.progressed: list[Req] = []  # got a token in the last step and still running (for streaming)
        self.num_retracted = 0
        self.cache_hit_tokens = 0  # prompt tokens served from the prefix cache, over first admissions
        self.prompt_tokens_admitted = 0
        self.shutdown = False

    # ---- messages -------------------------------------------------------------------------------

    def sync_and_apply(self, messages: list | None) -> None:
        """Rank 0 passes its new messages; every rank gets and applies the same list."""
        for msg in self.tp.broadcast_objects(messages):
            if isinstance(msg, AddReq):
                self.reqs[msg.req.rid] = msg.req
                self.waiting.append(msg.req)
            elif isinstance(msg, AbortReq):
                self.abort(msg.rid)
            elif isinstance(msg, Shutdown):
                self.shutdown = True

    def abort(self, rid: int) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def tick(self, messages: list | None) -> None:
        """One lockstep iteration, identical on every rank: agree on the messages, then step if there
        is work. Every driver (offline LLM, server, followers) advances the scheduler only this way."""
        self.sync_and_apply(messages)
        if self.has_work:
            self.step()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> None:
        self.progressed = []
        batch = self._prefill_batch() or self._decode_batch()
        if batch is not None:
            self._commit(batch, self.engine.step(batch))

    def _prefill_batch(self) -> Batch | None:
        """Requests with more than their last token to compute, in order, within the token budget:
        first the ones already running (chunked prefill goes on), then new admissions."""
        budget = self.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        for req in self.running:
            todo = req.seq_len - req.kv_len
            if todo > 1 and budget > 0:
                n = min(todo, budget)
                if not self.kv.reserve(req, n):
                    break
                reqs.append(req)
                lens.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            self.kv.admit(req)
            n = min(req.seq_len - req.kv_len, budget)
            # Leave a page per running request, so the next decode step does not have to retract.
            need = self.kv.pages_for(req.kv_len + n) - len(req.pages)
            if need + len(self.running) > self.kv.available_pages:
                self.kv.release(req)
                if not self.running:  # the whole pool is not enough: it can never run
                    self.waiting.popleft()
                    self._finish(req, "length")
                    continue
                break
            self.kv.reserve(req, n)
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            if not req.output_ids:  # first admission (not a retracted request coming back)
                self.cache_hit_tokens += req.kv_len
                self.prompt_tokens_admitted += len(req.prompt_ids)
            self.engine.sampler.prepare_row(req.row, req.params, req.seed, req.prompt_ids, req.output_ids,
                                            self._banned_early(req))
            self.running.append(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        return Batch(reqs, lens) if reqs else None

    def _decode_batch(self) -> Batch | None:
        """Every running request advances by one token; out of pages, retract the newest."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv.reserve(req, 1):
                i += 1
            elif len(self.running) > 1:
                self._retract(self.running[-1])
            else:  # even alone it does not fit: the pool is smaller than this sequence
                logger.warning("request %d needs more KV pages than the pool has; finishing it", req.rid)
                self._finish(req, "length")
        return Batch(list(self.running), [1] * len(self.running)) if self.running else None

    def _retract(self, req: Req) -> None:
        """Give back req's pages (into the prefix cache) and requeue it with what it has generated."""
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _release(self, req: Req) -> None:
        """A running request leaves (finished, aborted or retracted): free its sampler row and pages."""
        self.engine.sampler.release_row(req.row)
        self.kv.release(req)

    def _banned_early(self, req: Req) -> list[int]:
        """Tokens that would end the request, banned while fewer than min_tokens are generated."""
        if req.params.min_tokens == 0:
            return []
        eos = [] if req.params.ignore_eos else sorted(self.eos_ids)
        return eos + req.params.stop_token_ids

    # ---- results ---------------------------------------------------------------------------------

    def _commit(self, batch: Batch, out: StepOutput | None) -> None:
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        if out is None:
            return
        samples = out.samples
        tokens = samples.token_ids.tolist()
        logprobs = samples.logprobs.tolist() if samples.logprobs is not None else None
        top_ids = samples.top_ids.tolist() if samples.top_ids is not None else None
        top_lps = samples.top_logprobs.tolist() if samples.top_logprobs is not None else None
        for j, i in enumerate(out.sampled):
            req = batch.reqs[i]
            req.output_ids.append(tokens[j])
            if req.params.logprobs is not None:
                n = req.params.logprobs
                req.output_logprobs.append(TokenLogprob(tokens[j], logprobs[j],
                                                        list(zip(top_ids[j][:n], top_lps[j][:n]))))
            reason = self._stop_reason(req, tokens[j])
            if reason:
                self._finish(req, reason)
            else:
                self.progressed.append(req)

    def _stop_reason(self, req: Req, token: int) -> str | None:
        params, generated = req.params, len(req.output_ids)
        if generated >= params.min_tokens and (
                (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids):
            return "stop"
        if generated >= params.max_tokens or req.seq_len >= self.engine.max_seq_len:
            return "length"
        return None

    def _finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        del self.reqs[req.rid]
        self.finished.append(req)

    def stats(self) -> dict:
        return {
            "total_pages": self.engine.num_pages,
            "page_size": self.kv.page_size,
            "free_pages": self.kv.allocator.num_free,
            "evictable_pages": self.kv.cache.evictable_pages,
            "cached_pages": self.kv.cache.cached_pages,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_retracted": self.num_retracted,
            "cache_hit_tokens": self.cache_hit_tokens,
            "prompt_tokens_admitted": self.prompt_tokens_admitted,
        }
