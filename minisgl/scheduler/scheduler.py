"""Continuous batching: admit, build a batch, launch it, commit tokens, finish, retract.

One instance runs per TP rank. Rank 0 receives the messages and broadcasts them, so every rank
applies the same messages in the same order and takes the same decisions (lists, never sets).

With overlap scheduling each tick launches step N and only then reads step N-1's tokens, so the CPU
builds a batch and post-processes the last one while the device computes. The consequences, each
handled where it arises: a request may finish (EOS) after it was already put into step N, which then
computes one token for nothing; a request aborted, failed or retracted while its token is in flight
frees its pages at once (any later step that reuses them runs after step N on the same stream), and
its late token is committed or dropped when step N-1 is read; only tokens the host knows enter the
prefix cache.

A constrained request (structured outputs) waits aside while its grammar compiles in the background,
joins the waiting queue when rank 0 reports it compiled, and has its matcher advanced with every token
committed. Its mask for the next step needs its last token, which the forward pass does not: with
overlap, a batch holding constrained requests enqueues its forward pass, then reads the previous step
and advances the matchers while the device computes, then fills the masks and enqueues sampling. A
constrained request that the previous step finishes is in the batch already: its matcher is gone, its
mask row allows everything, and the token drawn for it is dropped like any finished request's.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from minisgl.constrained import Grammars
from minisgl.core import Batch, Req, ReqStatus, SamplingParams, TokenLogprob
from minisgl.distributed import TPGroup
from minisgl.engine.engine import Engine, LaunchedStep, PromptScores, StepResult
from minisgl.kvcache import KVCacheManager, make_prefix_cache
from minisgl.messages import AbortReq, AddReq, FlushCache, GrammarReady, Shutdown
from minisgl.scheduler.trace import StepTrace

logger = logging.getLogger(__name__)


# Prompt lengths of the warm-up: one per fused-MoE config row and attention variant a prefill may pick.
WARM_UP_LENGTHS = (4, 24, 48, 96, 192, 384, 768, 1536)
PREFILL_FLOOR = 64  # prefill tokens a step may always carry beside decodes (Scheduler._prefill_room)
MIN_TIMED_DECODES = 32  # fewer decodes than this: the token budget alone bounds a step (Scheduler._prefill_room)
CHUNK_TOKENS = 1024  # a prompt chunk beside decodes, unless they may stall or prompts pile up (_prefill_room)
MAX_CHUNKED_DECODES = 160  # beside more decodes than this, chunks are bounded by time alone (_prefill_room)
HEAVY_BUDGET_SHARE = 0.6  # beside that many, a step may cost this share of a whole budget's step (_heavy_ratio)
DRAIN_MS = 300.0  # prompts waiting longer than this to drain in chunks of CHUNK_TOKENS: a backlog (_prefill_room)
DRAIN_LEFT = 4  # a backlog ends with at most this many chunks of prompt tokens left
STALL_TOKENS = 100  # a stream earns one stall at admission and one per this many tokens (Scheduler._spend_stall)
BURST_CHUNK_TOKENS = 3072  # a light load's burst of prompts is computed in steps of this many (--burst-split)
BURST_MIN_MS = 50.0  # ... if computing it whole would take longer than this (Scheduler._light_burst)
LIGHT_LOAD_STEPS = 512  # light: fewer than MIN_TIMED_DECODES requests held at each of this many last steps
AGED_STEPS = 16  # a prompt waiting this many steps goes before shorter ones (--schedule-policy sjf)


class Scheduler:
    def __init__(self, engine: Engine, tp: TPGroup):
        args = engine.args
        self.engine, self.tp = engine, tp
        self.max_prefill_tokens = args.max_prefill_tokens
        self.max_running = args.max_running_requests
        self.step_ratio = args.max_mixed_step_ratio
        self.burst_split = args.burst_split
        self.shortest_first = args.schedule_policy == "sjf"
        self.steps = 0  # batches built so far: the clock that ages waiting prompts (_order_waiting)
        self.heavy_step = -LIGHT_LOAD_STEPS  # with burst_split: the last step with MIN_TIMED_DECODES requests held
        self.backlogged = False  # prompts pile up faster than chunks drain them (_backlogged)
        self.overlap = args.overlap_schedule
        self.eos_ids = set(engine.config.eos_token_ids)
        self.kv = KVCacheManager(engine.num_pages, args.page_size, make_prefix_cache(args.cache_type, args.page_size),
                                 engine.page_table, args.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.compiling: list[Req] = []  # constrained requests whose grammar is not compiled yet
        self.grammars: Grammars | None = None  # made with the first constrained request
        self.running: list[Req] = []  # admission order: the last one is the cheapest to retract
        self.reqs: dict[int, Req] = {}
        self.unread_step: LaunchedStep | None = None  # launched, results not read yet (overlap only)
        self.pending: Batch | None = None  # built, to launch at the next tick's start (see `step`)
        self.finished: list[Req] = []  # finished since the caller last took them (`take_outputs`)
        self.progressed: list[Req] = []  # got tokens in the last tick and still running (for streaming)
        self.last_step_tokens = 0  # the tokens of the step read in the last tick, as vLLM counts an iteration's
        self.num_retracted = 0
        self.cache_hit_tokens = 0  # prompt tokens served from the prefix cache, over first admissions
        self.prompt_tokens_admitted = 0
        self.shutdown = False
        # None unless MINISGL_STEP_TRACE is set
        self.trace = StepTrace.from_env(tp.is_leader, engine.device, engine.step_cost)

    # ---- messages -------------------------------------------------------------------------------

    def sync_and_apply(self, messages: list | None) -> None:
        """Rank 0 passes its new messages (plus the grammars it saw compiled); every rank gets and
        applies the same list."""
        if self.tp.is_leader and self.compiling:
            messages = [*(messages or []), *(GrammarReady(rid) for rid in self.grammars.ready())]
        for msg in self.tp.broadcast_objects(messages):
            if isinstance(msg, AddReq):
                self._add(msg.req)
            elif isinstance(msg, GrammarReady):
                self._grammar_ready(msg.rid)
            elif isinstance(msg, AbortReq):
                self.abort(msg.rid)
            elif isinstance(msg, FlushCache):
                self.kv.allocator.free(self.kv.cache.reset())
            elif isinstance(msg, Shutdown):
                self.shutdown = True

    def _add(self, req: Req) -> None:
        self.reqs[req.rid] = req
        constraint = req.params.constraint
        if constraint is None:
            self._enqueue(req)
            return
        if self.grammars is None:
            self.grammars = Grammars(self.engine.args.tokenizer_source(self.engine.model_path),
                                     self.engine.config.vocab_size, sorted(self.eos_ids), self.engine.device)
        self.grammars.start(req.rid, constraint)
        self.compiling.append(req)

    def _grammar_ready(self, rid: int) -> None:
        req = self.reqs.get(rid)
        if req is None or req not in self.compiling:  # aborted meanwhile
            return
        self.compiling.remove(req)
        try:
            self.grammars.activate(rid)
        except Exception as exc:
            self._fail(req, exc)
            return
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """Join the waiting queue, stamped with the step count that ages it (`_order_waiting`)."""
        req.queued_step = self.steps
        self.waiting.append(req)

    def abort(self, rid: int) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            self._finish(req, "abort")

    def warm_up(self, lengths: tuple[int, ...] | None = None) -> None:
        """Before the first user request: on a GPU, one greedy request per prefill size class, one after
        another, then a batch of sampled requests that extend a cached prefix; one tiny request of each kind
        elsewhere. Triton compiles a kernel variant (a fused-MoE tile config, the sampling kernels) the first
        time a batch needs it: that belongs to start-up, not to somebody's request. The size-class prompts
        start with different tokens, so none shortens another's prefill by a prefix hit. Nothing stays
        behind: every rank's prefix cache is emptied, the counters start from zero, and the step trace (if
        any) starts with the first user request: in one H100 trace the warm-up's 14 steps (146-313 ms each)
        were two fifths of a 64-stream level's step table. `lengths` overrides the choice (tests)."""
        room = min(self.max_prefill_tokens, self.engine.max_seq_len - 2, self.engine.num_pages * self.kv.page_size // 4)
        if lengths is None:
            lengths = WARM_UP_LENGTHS if self.engine.device.type == "cuda" else (4,)
        trace, self.trace = self.trace, None
        vocab = self.engine.config.vocab_size
        prompts = [[(i + 1 + t) % vocab for t in range(n)] for i, n in enumerate(n for n in lengths if n <= room)]
        greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            self._run_to_completion([Req(-1 - i, prompt, greedy, seed=0)])
        sampled = SamplingParams(temperature=0.7, max_tokens=2, ignore_eos=True)
        self._run_to_completion([Req(-1 - len(prompts) - k, prompts[0] + [k] * (k + 1), sampled, seed=k)
                                 for k in range(3 if prompts else 0)])
        self.tick([FlushCache()])
        self.take_outputs()
        self.num_retracted = self.cache_hit_tokens = self.prompt_tokens_admitted = 0
        self.trace = trace

    def _run_to_completion(self, reqs: list[Req]) -> None:
        self.tick([AddReq(req) for req in reqs])
        while self.has_work:
            self.tick([])

    def tick(self, messages: list | None) -> None:
        """One lockstep iteration, identical on every rank: agree on the messages, then step if there
        is work. Every driver (offline LLM, server, followers) advances the scheduler only this way."""
        self.last_step_tokens = 0
        start, retracted = time.monotonic(), self.num_retracted
        self.sync_and_apply(messages)
        batch = self.step() if self.has_work else None
        if self.trace is not None:  # `got`: a finish by abort brings no token
            got = [r for r in self.progressed + self.finished if r.output_ids and r.finish_reason != "abort"]
            self.trace.record(start, [m.req for m in messages or () if isinstance(m, AddReq)],
                              self.num_retracted - retracted, batch, got)

    @property
    def has_work(self) -> bool:
        return bool(self.can_step or self.compiling)

    @property
    def can_step(self) -> bool:
        """There is a batch to launch or a step to read (grammars compiling alone are not that)."""
        return bool(self.waiting or self.running or self.unread_step or self.pending)

    @property
    def constrained(self) -> bool:
        """Some admitted request has a grammar: its next mask needs its last token."""
        return bool(self.grammars and self.grammars.matchers)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> Batch | None:
        """Launch the next batch, then read the previous one (overlap) or this one (no overlap); returns the
        batch launched.

        Enqueuing a batch with prefill tokens still costs the host milliseconds (qwen3-0.6b on an H100, 64
        decodes + 1,500 prompt tokens: ~2 ms with its whole-step graph, engine/whole_graph.py, whose inputs,
        metadata, last-row logits and sampling stay eager; 3.4 ms with the piecewise graphs it replaced; 22 ms
        all eager, above the largest bucket), so reading the previous step after it holds that step's tokens for
        the whole launch. Reading it first instead (the
        batch built, the previous step read and its tokens sent, the batch launched at the next tick) leaves
        the device idle for that launch: every request of the batch waits that much longer, and a decoding
        stream sees one short gap then one long one. So it is done only where it serves more requests than
        it holds: when the previous step sampled at least as many first tokens as the batch has decodes of
        other requests (a lightly loaded server, where TTFT is what a user sees). Under load the launch
        overlaps as ever (reading first before every prefill batch cost a decode step per admission, a fifth
        of the throughput at 256 streams). (Deterministic: every TP rank decides alike.)

        A constrained request's mask needs the matcher to have seen its previous token; its forward pass
        does not (it reads that token from the device's token table). So a batch holding one is launched
        in two halves: forward pass, then (overlap) the previous step read while the device computes,
        then its masks filled and sampling enqueued."""
        self.progressed = []
        previous, self.unread_step = self.unread_step, None
        batch, self.pending = self.pending or self._next_batch(), None
        if batch is not None and previous is not None and not batch.is_decode and self._read_first(previous, batch):
            self._commit(previous)
            self.pending = batch
            return None
        launched = None
        if batch is not None:
            if self.trace is not None:
                self.trace.launching(batch, self.engine.step_kind(batch))
            forwarded = self.engine.forward(batch)
            if previous is not None and self._constrained(batch):
                self._commit(previous)
                previous = None
            launched = self.engine.sample(forwarded, self._bitmask(batch))
            if self.trace is not None:
                self.trace.launched(batch)
        if previous is not None:
            self._commit(previous)
        if self.overlap:
            self.unread_step = launched
        elif launched is not None:
            self._commit(launched)
        return batch

    @staticmethod
    def _read_first(previous: LaunchedStep, batch: Batch) -> bool:
        """Read `previous` before launching `batch` (see `step`): it samples some requests' first tokens (their
        prefill ends there), and no fewer of them than `batch` holds decodes of other requests (theirs do not
        count: their second token waits for the launch either way)."""
        first = {previous.batch.reqs[i].rid for i in previous.batch.sampled if not previous.batch.reqs[i].output_ids}
        others = sum(n == 1 and r.rid not in first for r, n in zip(batch.reqs, batch.extend_lens))
        return bool(first) and len(first) >= others

    def _next_batch(self) -> Batch | None:
        """The next batch, its requests' bookkeeping advanced as if it had run, its page-table entries sent.

        Decode first, then fill: every running request that has only its last token to compute gets one token, and
        prefill chunks (running requests' unfinished prompts first, then admissions in arrival order, or shortest
        first: `_fill`) fill what is left of ONE token budget per step, in the same batch (Sarathi-Serve's
        stall-free batching, vLLM's chunked prefill). The trade-off is the budget's size: a step costs about its
        token count once past a few thousand tokens, so a running stream's inter-token gap is at most one
        budget-sized step (prefill-first makes it wait behind every chunk of every prompt that arrives), while a
        prompt needs about `len / budget` steps to its first token, so a smaller budget raises TTFT in bursts.
        `max_prefill_tokens` (--max-num-batched-tokens) is that budget, decodes included; decodes are never dropped
        to respect it, so a step exceeds it only when more requests decode than it holds. A step without prefill
        tokens is a pure decode and replays a CUDA graph; one with prefill tokens replays a whole-step graph
        (engine/whole_graph.py; piecewise graphs around eager attention when the figures below were measured). Hence
        the server's default of 8192 (vLLM's for its API server; offline benchmarks use 16384): measured on an H100
        with the pieces, 2048 and 4096 lowered the ITL p99 only at 256 streams (96 -> 61 / 79 ms on qwen3-0.6b) and
        raised its TTFT p99 1.5-2.1x and cut its throughput by 11-20% (docs/benchmarks.md, 2026-11-25). A fixed
        token budget cannot serve both ends, since what a token costs depends on what else the step holds and a
        percentile counts stalls; `_prefill_room` therefore sizes the chunks beside decodes by the stalls each
        stream has left, and by time under a backlog."""
        self.steps += 1
        reqs, lens = self._decodes()
        self._fill(reqs, lens, self._prefill_room(reqs))
        if not reqs:
            return None
        batch = self._batch(reqs, lens)
        batch.scored = [(i, kv, min(kv + n, len(r.prompt_ids) - 1) - kv)
                        for i, (r, kv, n) in enumerate(zip(reqs, batch.kv_lens, lens))
                        if r.scores_prompt and kv < len(r.prompt_ids) - 1]
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        for i in batch.sampled:
            batch.reqs[i].unseen_tokens += 1
        self.kv.flush()
        return batch

    def _prefill_room(self, decodes: list[Req]) -> int:
        """Prefill tokens the next step may carry beside `decodes`: what is left of the token budget and, while at
        least MIN_TIMED_DECODES requests decode (with --max-mixed-step-ratio K and a measured step cost model):
        chunks of CHUNK_TOKENS, or the whole budget when every one of those decodes has a stall to spend
        (`_spend_stall`); while prompts pile up (`_backlogged`), no more than keeps the step within K times the cost
        of the decodes alone, and beside more than MAX_CHUNKED_DECODES decodes within `_heavy_ratio` times (K or
        more). At least PREFILL_FLOOR tokens, so a prompt always advances. With fewer decodes (none included), a
        light load's burst of prompts may be cut into steps of BURST_CHUNK_TOKENS instead, for its median TTFT
        (--burst-split; see `_light_burst`).

        Why chunks, and stalls to spend: the inter-token percentiles count stalls, not their length. A closed loop
        of 64 streams sends each round's ~40,000 prompt tokens within a few steps' time; cut by time alone (K x
        the decode step) they made ~14 steps of 5-27 ms on qwen3-0.6b (H100), ~10 stalls per stream per round,
        where a p99 allows ~2.5 (1% of 256 tokens). Chunks of 1,024 tokens keep a step near the decode step's
        time (Sarathi-Serve's budgets for tight inter-token targets are 512-2,048), and a whole-budget step,
        which stalls every stream once, is taken only when each of them has earned it: one stall at admission
        and one per STALL_TOKENS tokens, so no stream stalls in more than ~1% of its gaps.

        Why not always: small chunks drain a pile of prompts slowly, so its requests wait (TTFT) and decode late
        (throughput). When draining the waiting prompt tokens in chunks would take longer than DRAIN_MS (qwen3-8b's
        ~40,000 tokens take ~1.5 s, qwen3-0.6b's ~0.2 s), or the decode step is long anyway (beyond
        MAX_CHUNKED_DECODES), the step is bounded by time instead, as vLLM's budget is by tokens. The server's K
        is 3: beside shortest-first admission (`_order_waiting`) it paid back the stalls that earlier first tokens
        cost (H100, 64 streams: qwen3-8b ITL p99 38-40 ms, against 43-45 with K = 4), and at 256 streams it cut
        the ITL p99 by ~20% (qwen3-30b-a3b 96-103 against 124-127 ms) for a TTFT p50 11-18% higher and ~1% of
        the throughput; K = 2 against 3 raised qwen3-8b's TTFT p99 from 5.2 to 6.3 s (H200). The simulator
        (benchmarks/policy_sim.py) put the 256-stream cells of chunks without that bound at twice the median
        TTFT. Everything here is counted in tokens or modelled from the start-up cost model, which every
        tensor-parallel rank shares, so that the ranks agree."""
        room, cost = self.max_prefill_tokens - len(decodes), self.engine.step_cost
        if self.burst_split and len(self.running) + len(self.waiting) >= MIN_TIMED_DECODES:
            self.heavy_step = self.steps
        if room <= PREFILL_FLOOR:
            return room
        if len(decodes) < MIN_TIMED_DECODES:
            return min(room, BURST_CHUNK_TOKENS) if self.burst_split and self._light_burst() else room
        if cost is None or not self.step_ratio:
            return room
        kv_tokens, backlog = sum(r.kv_len for r in decodes), self._prompt_backlog()
        heavy = len(decodes) > MAX_CHUNKED_DECODES
        if self._backlogged(backlog, len(decodes), kv_tokens) or heavy:
            ratio = self._heavy_ratio(len(decodes), kv_tokens) if heavy else self.step_ratio
            return max(PREFILL_FLOOR, cost.prefill_room(len(decodes), kv_tokens, ratio, room))
        if backlog > CHUNK_TOKENS and self._spend_stall(decodes):
            return room
        return min(room, CHUNK_TOKENS)

    def _heavy_ratio(self, decodes: int, kv_tokens: int) -> float:
        """The step-cost ratio beside more than MAX_CHUNKED_DECODES decodes: K, or HEAVY_BUDGET_SHARE of a whole
        token budget's step, as a multiple of the decode step, if that is more.

        Why: at such loads prompts arrive every step, and a budget-bound scheduler's inter-token p99 is a whole
        budget's step (vLLM's at 256 streams, H100: qwen3-8b 200 ms, qwen3-30b-a3b 130). K decode steps stay far
        under that where a budget's step is many decode steps (qwen3-8b: ~10), and drain the prompts in small steps,
        which costs their first tokens and throughput. qwen3-8b at 256 streams on an H100, this bound (~6 there)
        against K = 3 alone, two servers each: TTFT p50 497-506 against 631-828 ms, p99 4.6 against 5.2-5.3 s,
        7,475-7,488 against 7,248-7,390 tok/s, for an ITL p99 of 130-134 against 61-64 ms (vLLM 0.26.0 there:
        916 ms, 4.2 s, 7,572 tok/s, 200 ms). Where a budget's step is a few decode steps (qwen3-0.6b,
        qwen3-30b-a3b: 2.3-3.6 at 256 streams) K stays the bound."""
        cost = self.engine.step_cost
        budget_share = HEAVY_BUDGET_SHARE * cost.ms(self.max_prefill_tokens, kv_tokens) / cost.ms(decodes, kv_tokens)
        return max(self.step_ratio, budget_share)

    def _backlogged(self, backlog: int, decodes: int, kv_tokens: int) -> bool:
        """Whether `backlog` prompt tokens would take longer than DRAIN_MS to drain in chunks of CHUNK_TOKENS beside
        the decodes; once so, until no more than DRAIN_LEFT chunks are left (so that a burst still arriving does
        not flip the step size from one step to the next)."""
        drain_ms = backlog / CHUNK_TOKENS * self.engine.step_cost.ms(decodes + CHUNK_TOKENS, kv_tokens)
        if drain_ms > DRAIN_MS:
            self.backlogged = True
        elif backlog <= DRAIN_LEFT * CHUNK_TOKENS:
            self.backlogged = False
        return self.backlogged

    def _spend_stall(self, decodes: list[Req]) -> bool:
        """If every one of `decodes` has a stall left (one at admission and one per STALL_TOKENS tokens since), spend
        one each and say so: the step about to be built may stall them. A step without decodes stalls nobody."""
        if any(r.stalls * STALL_TOKENS > len(r.output_ids) for r in decodes):
            return False
        for r in decodes:
            r.stalls += 1
        return True

    def _light_burst(self) -> bool:
        """Whether the prompts waiting to be computed are a light load's burst, to be cut into steps of
        BURST_CHUNK_TOKENS (--burst-split): fewer than MIN_TIMED_DECODES requests held at each of the last
        LIGHT_LOAD_STEPS steps, at most two token budgets of prompt tokens to compute, and more than BURST_MIN_MS of
        device time to compute them in (by the step cost model; none without one).

        Why cut: 16 closed-loop streams send their next prompts within a few milliseconds, and in budget-sized steps
        most of them get their first token only after the largest step (qwen3-8b, H100: TTFT p50 241-247 ms); in
        steps of 3,072 tokens the first prompts finish a step or two sooner (147-154 ms), while the streams already
        decoding stall in at most a few steps per burst: 3,072 is the smallest chunk at which the policy simulator
        kept the stalled gaps under 1% (2,048: 1.5%, and an ITL p99 five times the decode step's). Why only then:
        a heavier load's burst (64 streams: ~40,000 tokens) drains fastest in whole budgets, and cut while it was
        still arriving (the API admits a request every ~0.7 ms, so fewer are held at first) it raised qwen3-30b-a3b's
        64-stream TTFT p50 by 8-27% on an H100; the window of steps remembers the load from one round to the next.
        A burst computed within BURST_MIN_MS anyway gains little from being cut and pays a stall of the running
        streams per cut: qwen3-0.6b's 16-stream burst (~10,000 tokens, ~18 ms on an H100) cut gave a TTFT p50 7%
        lower for an inter-token p99 21% higher. Counted in requests, tokens and the start-up cost model, which every
        tensor-parallel rank shares, so that the ranks agree."""
        backlog, cost = self._prompt_backlog(), self.engine.step_cost
        return (self.steps - self.heavy_step >= LIGHT_LOAD_STEPS and backlog <= 2 * self.max_prefill_tokens
                and cost is not None and cost.ms(backlog) > BURST_MIN_MS)

    def _prompt_backlog(self) -> int:
        """Prompt tokens not computed yet: the running requests' unfinished prompts and the waiting ones'."""
        running = sum(r.device_len - r.kv_len for r in self.running if r.device_len - r.kv_len > 1)
        return running + sum(r.seq_len - r.kv_len for r in self.waiting)

    def _constrained(self, batch: Batch) -> bool:
        """Some request the batch samples for has a grammar."""
        return self.constrained and any(batch.reqs[i].params.constraint is not None for i in batch.sampled)

    def _bitmask(self, batch: Batch) -> torch.Tensor | None:
        """The grammars' masks for the batch's sampled requests; None when none of them has a matcher left."""
        return self.grammars.bitmask([batch.reqs[i].rid for i in batch.sampled]) if self.constrained else None

    def _fill(self, reqs: list[Req], lens: list[int], budget: int) -> None:
        """Append prefill chunks within `budget` tokens: first the running requests' unfinished prompts (chunked
        prefill goes on, oldest first), then new admissions in arrival order, or shortest first with
        --schedule-policy sjf (`_order_waiting`)."""
        for req in self.running:
            todo = req.device_len - req.kv_len
            if todo > 1 and budget > 0:
                n = min(todo, budget)
                if not self.kv.reserve(req, n):
                    break
                reqs.append(req)
                lens.append(n)
                budget -= n
        if self.shortest_first and budget > 0 and len(self.waiting) > 1 and len(self.running) < self.max_running:
            self._order_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.unseen_tokens:  # retracted while its last token was in flight: wait for that token
                break
            try:
                n = self._admit(req, budget)
            except Exception as exc:  # this request's own fault: fail it alone
                self._fail(req, exc)
                continue
            if n is None:
                break
            if n == 0:  # finished instead: it can never fit
                continue
            reqs.append(req)
            lens.append(n)
            budget -= n

    def _order_waiting(self) -> None:
        """Shortest prompt first (--schedule-policy sjf): retracted requests first, as ever, then prompts that have
        waited AGED_STEPS steps, in arrival order, then the rest by length, shortest first.

        Why: beside 32 or more decodes a burst of prompts comes in a chunk at a time over many steps, whatever their
        order, and each prompt's first token waits for the prompts admitted before it; short ones first, fewer
        tokens stand before the median one (64 streams on an H100, with the server's K = 3: TTFT p50 qwen3-8b
        358-389 ms against 439-512, qwen3-30b-a3b 270-291 against 311-365). The price: the first tokens come
        sooner, so more streams decode while the longer prompts are chunked in, and stall (with K = 4, qwen3-8b's
        inter-token p99 43-45 against 36-37 ms; K = 3 pays that back, not qwen3-30b-a3b's: 73-74 against 52-81),
        and the longest prompts wait a little longer (TTFT p99 +2-10%). The server's default; fcfs offline, where
        no one waits for a first token. Why the age: by length alone a long prompt can be overtaken by every
        shorter one that arrives after it (policy simulator, qwen3-0.6b at 64 streams: TTFT p99 +65% without the
        age, +21% with it); after AGED_STEPS steps it keeps its place. Counted in steps, so tensor-parallel ranks
        agree."""
        def key(req: Req) -> tuple[int, int]:
            if req.output_ids:  # retracted: back first, in the order retraction left them
                return 0, 0
            if self.steps - req.queued_step >= AGED_STEPS:
                return 1, req.queued_step
            return 2, len(req.prompt_ids)

        self.waiting = deque(sorted(self.waiting, key=key))

    def _admit(self, req: Req, budget: int) -> int | None:
        """Move the first waiting request into running with pages for its first chunk; returns the
        chunk's length, None when it must wait for pages, 0 when it can never fit (finished)."""
        self.kv.admit(req, match=not req.scores_prompt)
        n = min(req.seq_len - req.kv_len, budget)
        # Leave a page per running request, so the next decode step does not have to retract.
        need = self.kv.pages_for(req.kv_len + n) - len(req.pages)
        if need + len(self.running) > self.kv.available_pages:
            self.kv.release(req)
            if not self.running:  # the whole pool is not enough: it can never run
                self._finish(req, "length")
                return 0
            return None
        self.kv.reserve(req, n)
        self.engine.load_tokens(req.row, req.kv_len, req.tokens(req.kv_len, req.seq_len))
        self.engine.sampler.prepare_row(req.row, req.params, req.seed, req.prompt_ids, req.output_ids,
                                        self._banned_early(req))
        self.waiting.popleft()
        req.status = ReqStatus.RUNNING
        if not req.output_ids:  # first admission (not a retracted request coming back)
            self.cache_hit_tokens += req.kv_len
            self.prompt_tokens_admitted += len(req.prompt_ids)
        self.running.append(req)
        return n

    def _decodes(self) -> tuple[list[Req], list[int]]:
        """Every running request with only its last token to compute advances by one token; out of pages,
        retract the newest (never one already taken: those come before it)."""
        reqs: list[Req] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.device_len - req.kv_len != 1 or self._awaits_last_token(req):  # prefilling, or nothing to do
                i += 1
            elif self.kv.reserve(req, 1):
                reqs.append(req)
                i += 1
            elif len(self.running) > 1:
                self._retract(self.running[-1])
            else:  # even alone it does not fit: the pool is smaller than this sequence
                logger.warning("request %d needs more KV pages than the pool has; finishing it", req.rid)
                self._finish(req, "length")
        return reqs, [1] * len(reqs)

    def _batch(self, reqs: list[Req], lens: list[int]) -> Batch:
        sampled = [i for i, (r, n) in enumerate(zip(reqs, lens)) if r.kv_len + n == r.device_len]
        return Batch(reqs, [r.kv_len for r in reqs], lens, sampled)

    def _awaits_last_token(self, req: Req) -> bool:
        """Its in-flight token is its last one (max_tokens or the length limit): nothing to compute."""
        return req.unseen_tokens > 0 and (len(req.output_ids) + req.unseen_tokens >= req.params.max_tokens
                                      or req.device_len >= self.engine.max_seq_len)

    def _retract(self, req: Req) -> None:
        """Give back req's pages (into the prefix cache) and requeue it with what it has generated."""
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _release(self, req: Req) -> None:
        """A request leaves the device (finished, aborted, failed or retracted): free its sampler row
        and pages, if it holds any."""
        if req.row != -1:
            self.engine.sampler.release_row(req.row)
            self.kv.release(req)

    def _banned_early(self, req: Req) -> list[int]:
        """Tokens that would end the request, banned while fewer than min_tokens are generated."""
        if req.params.min_tokens == 0:
            return []
        eos = [] if req.params.ignore_eos else sorted(self.eos_ids)
        return eos + req.params.stop_token_ids

    # ---- results ---------------------------------------------------------------------------------

    def _commit(self, step: LaunchedStep) -> None:
        """Append the step's sampled tokens and finish the requests they end."""
        if self.trace is not None:
            self.trace.reading()
        result, batch = step.result(), step.batch
        if self.trace is not None:
            self.trace.read(batch)
        for scores in result.prompt:
            self._record_prompt_scores(batch.reqs[scores.index], scores)
        for j, i in enumerate(batch.sampled):
            req = batch.reqs[i]
            req.unseen_tokens -= 1
            if req.status is ReqStatus.FINISHED:  # aborted or failed while this token was in flight
                continue
            # vLLM's iteration tokens: the tokens kept, plus the whole prompt of a request's first token (counted
            # once, when its prefill completes, however it was chunked or cached)
            self.last_step_tokens += 1 + (len(req.prompt_ids) if not req.output_ids else 0)
            try:
                reason = self._append(req, result, j)
            except Exception as exc:
                self._fail(req, exc)
                continue
            if reason:
                self._finish(req, reason)
            else:
                self.progressed.append(req)

    def _append(self, req: Req, result: StepResult, j: int) -> str | None:
        token = result.token_ids[j]
        req.output_ids.append(token)
        if req.params.logprobs is not None:
            n = req.params.logprobs
            req.output_logprobs.append(TokenLogprob(token, result.logprobs[j],
                                                    list(zip(result.top_ids[j][:n], result.top_logprobs[j][:n]))))
        if req.params.return_hidden_states:
            req.hidden_state = result.hidden[j]
        if req.params.constraint is not None and self.grammars.accept(req.rid, token):
            return "stop"  # the grammar is complete and took its end token
        return self._stop_reason(req, token)

    @staticmethod
    def _record_prompt_scores(req: Req, scores: PromptScores) -> None:
        """Keep the prompt logprobs of positions not recorded yet (a request retracted while it scored its
        prompt computes them again)."""
        for j, logprob in enumerate(scores.logprobs):
            position = scores.first + 1 + j
            if position == len(req.prompt_logprobs) + 1:
                top = list(zip(scores.top_ids[j], scores.top_logprobs[j]))
                req.prompt_logprobs.append(TokenLogprob(req.prompt_ids[position], logprob, top))

    def _stop_reason(self, req: Req, token: int) -> str | None:
        params, generated = req.params, len(req.output_ids)
        if generated >= params.min_tokens and (
                (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids):
            return "stop"
        if generated >= params.max_tokens or req.seq_len >= self.engine.max_seq_len:
            return "length"
        return None

    def _fail(self, req: Req, exc: Exception) -> None:
        """Handling this one request raised: it ends with its error, the others go on."""
        logger.exception("request %d failed; finishing it alone", req.rid)
        req.error = f"{type(exc).__name__}: {exc}"
        self._finish(req, "abort")

    def _finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.FINISHED:
            return
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.compiling:
            self.compiling.remove(req)
        if req.params.constraint is not None:
            self.grammars.release(req.rid)
        self._release(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        del self.reqs[req.rid]
        self.finished.append(req)

    def take_outputs(self) -> tuple[list[Req], list[Req]]:
        """Hand over the requests that got tokens in the last step and still run, and those finished since the last
        call: each finish is reported once, and the scheduler keeps no request it has let go of."""
        progressed, finished = self.progressed, self.finished
        self.progressed, self.finished = [], []
        return progressed, finished

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
