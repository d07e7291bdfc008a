"""Whole-step CUDA graphs for steps with prefill tokens: one graph per token bucket, attention included.

Why: a step that carries prefill tokens (a prefill, or decodes mixed with prefill chunks) costs the host far more
to enqueue than the device needs to run it when its few hundred kernels are launched one by one (qwen3-0.6b,
H100: ~24 ms against 2.5 ms for a 626-token prompt). That host time is the first token's wait and, under load,
every other stream's inter-token gap. Piecewise graphs (everything but attention replayed per token bucket, L + 1
pieces around L eager attention calls) were the first answer, but under load their enqueue still set the pace: on
an H100 serving qwen3-0.6b at 64 closed-loop streams, enqueuing a mixed step's pieces was 8.3 ms of a 14 ms mean
long inter-token gap, the device's span of those steps ~9 ms (the device waited on the host), and a py-spy profile
put most of it in Triton's Python launcher for the two attention kernels of each layer. Offline
(benchmarks/step_enqueue.py, 64 decodes + 2,900 prompt tokens) the host took 2.5 ms, 1.15 ms of it the 28 eager
attention calls and 0.45 ms the 29 piece replays. vLLM calls the answer FULL cudagraph mode for mixed batches.

How: the whole forward (embedding to final norm, the TP all-reduces included) is captured at each bucket's token
count T, attention included. Attention's launches must then not depend on the step's lengths, only on the bucket:
its metadata live in one static device buffer (attention/triton_backend.py StaticStepMeta) sized by the bucket's
caps, and padding entries make their programs exit at once. The leading decode rows (at most min(T, max running
requests) of them: every step that fits the bucket) run the split-K decode kernel on a fixed grid, padding rows of
seq_len 0; the other requests (at most MAX_CHUNKS prompt chunks) run the extend kernel over a tile list whose grid
is cdiv(T, tokens per tile) + MAX_CHUNKS programs per KV head (no empty (tile, request) pairs, which a grid of
tiles x requests would launch by the thousand). The decode kernel runs even when the step has no decodes: its
padding programs exit, a few microseconds of device time a layer, against two variants per bucket.
A step's enqueue is then: the engine's inputs (extend_input), one host->device copy of the metadata, three
device copies of ids, positions and KV slots into static buffers (rows past the real tokens keep stale, valid ids
and positions and store their K/V at the pool's scratch slot; every op outside attention works row by row, and no
attention program reads or writes their rows), one replay; then the eager logits of the last rows, as before.
A step with more chunks than MAX_CHUNKS, or more tokens than the largest bucket, runs eagerly (the same kernels,
grids from its own counts). All buckets share one memory pool, captured largest first.

Which buckets: up to the flag's cap, and only while the step is host-bound when run eagerly. Each bucket is
first run eagerly (which also compiles its kernels), smallest first, timing the host's enqueue against the
device's whole run; the first bucket whose device time exceeds the enqueue by DEVICE_BOUND is the last one
kept. Above it a graph saves nothing the device would notice (the host enqueues the next step while the
device still runs this one) and its padding costs device time. DEVICE_BOUND is 2, not just above 1, because
in that same window the host also builds the next batch: on an H200 at 256 streams, building a qwen3-0.6b
step with a dozen admissions took ~14 ms, about its 7,680-token enqueue (12 ms), and with a bound of 1.25 the
steps above 7,680 tokens ran eagerly (28 ms to enqueue) and left the device idle (qwen3-8b kept 1,024).
(Those figures were measured with piecewise graphs, whose eager runs left attention out.)
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from minisgl.attention.base import ForwardInput, StepAttention
from minisgl.attention.triton_backend import StaticStepMeta, TritonBackend
from minisgl.engine.cuda_graph import gc_paused

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, StepAttention], torch.Tensor]  # (ids [T], positions [T], attn)

MAX_CHUNKS = 64  # requests other than the leading decodes a captured step holds (the extend grid's padding bound)
SMALL_BUCKETS = (16, 32, 64, 128, 256)  # powers of two for short steps
# then one bucket every 64 tokens up to 2048, every 256 above. Why this fine: a step pads its tokens up to its
# bucket, and padding rows cost what real ones do. At one bucket per 256 tokens a qwen3-8b prompt of 529 tokens ran
# as 768 (15.8 ms on an H100 by the start-up step cost model, against ~11 for 529): a lone request's first token
# waited a third longer. At 64 a step wastes ~32 rows on average (~0.6 ms for qwen3-8b); the price is more buckets
# to time and capture at start-up, in one shared memory pool.
STEPS = ((2048, 64), (8192, 256))
DEVICE_BOUND = 2.0  # an eager step whose device time is this multiple of its enqueue is device-bound


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture, smallest first: SMALL_BUCKETS, then STEPS' spacing (padding wastes at most 63
    rows up to 2048 tokens, 255 above), and max_tokens itself."""
    if max_tokens <= 0:
        return []
    sizes, low = {t for t in SMALL_BUCKETS if t <= max_tokens}, SMALL_BUCKETS[-1]
    for high, step in STEPS:
        sizes |= set(range(low + step, min(high, max_tokens) + 1, step))
        low = high
    sizes |= set(range(low + STEPS[-1][1], max_tokens + 1, STEPS[-1][1]))
    return sorted(sizes | {max_tokens})


def timing_ids(count: int, vocab_size: int) -> torch.Tensor:
    """`count` token ids for the runs that time the buckets (and for padding rows no real step has written yet), on
    the CPU: varied, so that a MoE router spreads them over the experts as it does a served step's tokens. All
    zeros, every token went to the same top-k experts: qwen3-30b-a3b's 16-token step timed 4.6 ms on an H100 where
    its served decode steps at 16 streams read ~10x those experts' weights. The same ids on every tensor-parallel
    rank."""
    return torch.randint(vocab_size, (count,), generator=torch.Generator().manual_seed(0))


def bucket_for(buckets: list[int], tokens: int) -> int | None:
    """The smallest bucket holding `tokens`, or None when the step is larger than every bucket."""
    return next((b for b in buckets if b >= tokens), None)


class WholeGraphs:
    """One CUDA graph of `forward`, attention included, for each bucket of token counts; `run` replays one."""

    def __init__(self, forward: Forward, backend: TritonBackend, scratch_slot: int, pad_row: int, max_tokens: int,
                 max_decodes: int, heads: int, vocab_size: int, device: torch.device,
                 any_rank: Callable[[bool], bool] = bool):
        """`backend` attends over its pool, which gets the k/v (stored by the captured rope); `scratch_slot` is a
        pool slot nobody reads, where padding rows store theirs, and `pad_row` a page-table row of scratch pages;
        `max_decodes`: the most decode rows a step holds (max running requests); `vocab_size`: the model's, for
        the timing runs' ids (`timing_ids`); `any_rank(flag)`: whether any tensor-parallel rank says so (every
        rank must keep the same buckets)."""
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.pool, self.scratch_slot = self.buckets[-1], backend.pool, scratch_slot
        self.backend, self.max_decodes = backend, max_decodes
        self.static = StaticStepMeta(backend, heads, min(max_decodes, self.max_tokens),
                                     min(MAX_CHUNKS, self.max_tokens), pad_row)
        head_dim = self.pool.k.shape[-1]
        self.ids = timing_ids(self.max_tokens, vocab_size).to(device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((self.max_tokens,), scratch_slot, dtype=torch.int64, device=device)
        # Attention's output, shared by every layer and bucket: rows no program writes (padding) keep finite values.
        self.attn_out = torch.zeros(self.max_tokens, heads * head_dim, dtype=self.pool.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.attention: dict[int, StepAttention] = {}  # each bucket's, over its static metadata (and split scratch)
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        torch.cuda.synchronize(device)  # the buffers above are written on the current stream; capture uses `stream`
        with gc_paused(), torch.inference_mode(), torch.cuda.stream(stream):
            self.buckets = self._host_bound(forward, device, any_rank)
            self.max_tokens = self.buckets[-1]
            for tokens in reversed(self.buckets):  # largest first: smaller buckets reuse its memory
                self._capture(forward, tokens, pool, stream)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured whole-step CUDA graphs for steps with prefill tokens of 1..%d tokens (%d buckets; %s) "
                    "in %.1f s, %.0f MiB", self.max_tokens, len(self.buckets), self.timings, self.capture_seconds,
                    self.memory_bytes / 2**20)

    def caps(self, tokens: int) -> tuple[int, int]:
        """Bucket `tokens`' most decode rows (every step it holds: they are at most its tokens and the running
        requests) and most other requests."""
        return min(tokens, self.max_decodes), min(tokens, MAX_CHUNKS)

    def _step_attention(self, tokens: int) -> StepAttention:
        """Bucket `tokens`' attention: k/v to the static slots, the kernels over the static metadata, into the
        static output."""
        if tokens not in self.attention:
            meta, out = self.static.meta(tokens, *self.caps(tokens)), self.attn_out[:tokens]
            self.attention[tokens] = StepAttention(self.pool, self.slots[:tokens],
                                                   lambda layer, q: self.backend.attend(layer, q, meta, out))
        return self.attention[tokens]

    def _host_bound(self, forward: Forward, device: torch.device, any_rank: Callable[[bool], bool]) -> list[int]:
        """The buckets up to the first whose eager run is device-bound (see the module's docstring), each run
        eagerly twice (the first compiles) with all-padding metadata (attention's launches, none of its work);
        `timings` keeps 'tokens: enqueue/device ms' for the log."""
        kept, self.timings = [], []
        for tokens in self.buckets:
            ids, positions, attention = self.ids[:tokens], self.positions[:tokens], self._step_attention(tokens)
            forward(ids, positions, attention)
            torch.cuda.synchronize(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = time.perf_counter()
            forward(ids, positions, attention)
            host_ms = 1000 * (time.perf_counter() - start)
            end.record()
            end.synchronize()
            device_ms = begin.elapsed_time(end)
            kept.append(tokens)
            self.timings.append(f"{tokens}: {host_ms:.1f}/{device_ms:.1f} ms")
            if any_rank(device_ms > DEVICE_BOUND * host_ms):
                break
        for tokens in set(self.attention) - set(kept):
            del self.attention[tokens]
        return kept

    def _capture(self, forward: Forward, tokens: int, pool, stream: torch.cuda.Stream) -> None:
        """Capture `forward` at `tokens` (warmed up by `_host_bound`)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread polling events must not invalidate this thread's capture.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            hidden = forward(self.ids[:tokens], self.positions[:tokens], self._step_attention(tokens))
        self.graphs[tokens], self.hidden[tokens] = graph, hidden

    def fits(self, tokens: int, chunks: int) -> bool:
        """Whether a step of `tokens` tokens, `chunks` of its requests not leading decodes, replays a graph."""
        return tokens <= self.max_tokens and chunks <= MAX_CHUNKS

    def run(self, inputs: ForwardInput, rows: list[int], kv_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """The final hidden state [n, H] of the step's n tokens (it must fit: `fits`), whose requests' page-table
        rows and lengths are the host lists (inputs.decode_rows of them lead as decodes); overwritten by the next
        run."""
        n = inputs.input_ids.shape[0]
        tokens = bucket_for(self.buckets, n)
        self.static.write(rows, kv_lens, extend_lens, inputs.decode_rows)
        self.ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slots[:n].copy_(inputs.out_slots)
        self.slots[n:tokens].fill_(self.scratch_slot)  # a larger step left real slots there
        self.graphs[tokens].replay()
        return self.hidden[tokens][:n]

    def replay_without_attention(self, tokens: int) -> None:
        """Replay bucket `tokens` as capture left it: metadata all padding, so every attention program exits at
        once. That is what a step of that many tokens runs but attention, for the step cost model to time
        (engine/step_cost.py). Only before serving: the static metadata and slots must still be padding."""
        self.graphs[tokens].replay()

    def release(self) -> None:
        """Destroy the graphs now (under tensor parallelism, before the NCCL communicator: see DecodeGraphs)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.hidden.clear()
        self.attention.clear()
