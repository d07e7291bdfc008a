"""Piecewise CUDA graphs for steps with prefill tokens: everything but attention replayed from graphs.

Why: a step that carries prefill tokens (a prefill, or decodes mixed with prefill chunks) cannot replay a
whole-forward graph, because its attention depends on every request's lengths. Run eagerly, enqueuing its
few hundred kernels costs the host about ten times what the device needs for a prompt of a few hundred
tokens (qwen3-0.6b, H100: ~24 ms against 2.5 ms for 626 tokens). That host time is the first token's wait
and, under load, every other stream's inter-token gap. Everything outside attention (embedding, norms,
projections, rope, MLP or MoE, TP all-reduces) depends only on the number of tokens, so it is captured per
token-count bucket; attention runs eagerly on the real tokens between the pieces.

How: the model calls attention through a `StepAttention`: each layer's rope writes its k/v into the KV pool at
the step's slots, then calls `attend(layer, q)`. Capturing the whole forward at a bucket's size T, the slots
are a static buffer (so the store is captured with the rope), and the callback copies q into a static buffer,
ends the current graph and begins the next, and hands back a static output buffer that the next piece reads:
L layers make L + 1 graphs. A replay copies the step's input ids, positions and KV slots into
the static inputs (rows past the real tokens keep stale, valid ids and positions: every op outside attention
works row by row, so padding rows never touch real ones; their slots point at the pool's scratch slot),
replays piece i, runs attention on the first n rows of the static q into the static output, and so on; the
final hidden state's first n rows are the step's. Attention `prepare` and attention itself, and the logits
of the last rows, stay eager. All buckets and pieces share one memory pool, replayed in capture order.

Which buckets: up to the flag's cap, and only while the step is host-bound when run eagerly. Each bucket is
first run eagerly (which also compiles its kernels), smallest first, timing the host's enqueue against the
device's whole run; the first bucket whose device time exceeds the enqueue by DEVICE_BOUND is the last one
kept. Above it a graph saves nothing the device would notice (the host enqueues the next step while the
device still runs this one) and its padding costs device time. DEVICE_BOUND is 2, not just above 1, because
in that same window the host also builds the next batch: on an H200 at 256 streams, building a qwen3-0.6b
step with a dozen admissions took ~14 ms, about its 7,680-token enqueue (12 ms), and with a bound of 1.25 the
steps above 7,680 tokens ran eagerly (28 ms to enqueue) and left the device idle (qwen3-8b kept 1,024).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from minisgl.attention.base import StepAttention
from minisgl.engine.cuda_graph import gc_paused
from minisgl.kvcache.pool import KVPool

logger = logging.getLogger(__name__)

Attend = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, q [T, heads, D]) -> [T, heads * D]
Forward = Callable[[torch.Tensor, torch.Tensor, StepAttention], torch.Tensor]  # (ids [T], positions [T], attn)
AttendInto = Callable[[int, torch.Tensor, torch.Tensor], object]  # (layer, q [n, heads, D], out [n, heads * D])

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


def bucket_for(buckets: list[int], tokens: int) -> int | None:
    """The smallest bucket holding `tokens`, or None when the step is larger than every bucket."""
    return next((b for b in buckets if b >= tokens), None)


class PiecewiseGraphs:
    """The pieces of `forward` for each bucket of token counts; `run` replays them around eager attention."""

    def __init__(self, forward: Forward, pool: KVPool, scratch_slot: int, max_tokens: int, heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, any_rank: Callable[[bool], bool] = bool):
        """`pool` gets the k/v (stored by the captured rope); `scratch_slot` is a pool slot nobody reads, where
        padding rows store theirs; `any_rank(flag)`: whether any tensor-parallel rank says so (every rank
        must keep the same buckets)."""
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.pool, self.scratch_slot = self.buckets[-1], pool, scratch_slot
        self.ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((self.max_tokens,), scratch_slot, dtype=torch.int64, device=device)
        self.q = torch.zeros(self.max_tokens, heads, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(self.max_tokens, heads * head_dim, dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.layers: list[int] = []  # the layer of each attention call, in the forward's order
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        torch.cuda.synchronize(device)  # the buffers above are written on the current stream; capture uses `stream`
        with gc_paused(), torch.inference_mode(), torch.cuda.stream(stream):
            self.buckets = self._host_bound(forward, device, any_rank)
            self.max_tokens = self.buckets[-1]
            for tokens in reversed(self.buckets):  # largest first: smaller buckets reuse its memory
                self._capture(forward, tokens, pool)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured piecewise CUDA graphs for steps of 1..%d tokens (%d buckets x %d pieces; %s) in "
                    "%.1f s, %.0f MiB", self.max_tokens, len(self.buckets), len(self.layers) + 1, self.timings,
                    self.capture_seconds, self.memory_bytes / 2**20)

    def _host_bound(self, forward: Forward, device: torch.device, any_rank: Callable[[bool], bool]) -> list[int]:
        """The buckets up to the first whose eager run is device-bound (see the module's docstring), each run
        eagerly twice (the first compiles); `timings` keeps 'tokens: enqueue/device ms' for the log."""
        kept, self.timings = [], []
        for tokens in self.buckets:
            ids, positions = self.ids[:tokens], self.positions[:tokens]
            forward(ids, positions, self._step_attention(tokens, self._eager_split(tokens)))
            torch.cuda.synchronize(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = time.perf_counter()
            forward(ids, positions, self._step_attention(tokens, self._eager_split(tokens)))
            host_ms = 1000 * (time.perf_counter() - start)
            end.record()
            end.synchronize()
            device_ms = begin.elapsed_time(end)
            kept.append(tokens)
            self.timings.append(f"{tokens}: {host_ms:.1f}/{device_ms:.1f} ms")
            if any_rank(device_ms > DEVICE_BOUND * host_ms):
                break
        return kept

    def _step_attention(self, tokens: int, split: Attend) -> StepAttention:
        """The model's view of attention in a piece: k/v to the static slots, `split` at each attention call."""
        return StepAttention(self.pool, self.slots[:tokens], split)

    def _eager_split(self, tokens: int) -> Attend:
        """What a piece does at each attention call (its k/v are in the pool already): q into its static
        buffer; the static output, which the next piece reads (attention itself runs between replays)."""
        def split(layer: int, q: torch.Tensor) -> torch.Tensor:
            self.q[:tokens].copy_(q)
            return self.attn_out[:tokens]
        return split

    def _capture(self, forward: Forward, tokens: int, pool) -> None:
        """Capture `forward` at `tokens` (warmed up by `_host_bound`) in pieces, split at each attention call."""
        pieces: list[torch.cuda.CUDAGraph] = []
        layers: list[int] = []
        eager = self._eager_split(tokens)

        def split(layer: int, q: torch.Tensor) -> torch.Tensor:
            out = eager(layer, q)
            layers.append(layer)
            current[0].capture_end()
            pieces.append(current[0])
            current[0] = _begin(pool)
            return out

        ids, positions = self.ids[:tokens], self.positions[:tokens]
        current = [_begin(pool)]
        try:
            hidden = forward(ids, positions, self._step_attention(tokens, split))
            current[0].capture_end()
        except BaseException:
            _abandon(current[0])
            raise
        pieces.append(current[0])
        if self.layers and layers != self.layers:
            raise RuntimeError(f"attention calls differ between buckets: {layers} vs {self.layers}")
        self.layers, self.pieces[tokens], self.hidden[tokens] = layers, pieces, hidden

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            attend: AttendInto) -> torch.Tensor:
        """The final hidden state [n, H] of n tokens (n <= max_tokens), whose K/V go to `slots`; overwritten
        by the next run."""
        n = input_ids.shape[0]
        tokens = bucket_for(self.buckets, n)
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.slots[n:tokens].fill_(self.scratch_slot)  # a larger step left real slots there
        pieces = self.pieces[tokens]
        for piece, layer in zip(pieces, self.layers):
            piece.replay()
            attend(layer, self.q[:n], self.attn_out[:n])
        pieces[-1].replay()
        return self.hidden[tokens][:n]

    def replay_without_attention(self, tokens: int) -> None:
        """Replay bucket `tokens`' pieces back to back, attention left out: everything a step of that many tokens
        runs but attention, for the step cost model to time (engine/step_cost.py). Only before serving: the
        static slots must still all be the scratch slot."""
        for piece in self.pieces[tokens]:
            piece.replay()

    def release(self) -> None:
        """Destroy the graphs now (under tensor parallelism, before the NCCL communicator: see DecodeGraphs)."""
        for pieces in self.pieces.values():
            for piece in pieces:
                piece.reset()
        self.pieces.clear()
        self.hidden.clear()


def _begin(pool) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread polling events must not invalidate this thread's capture.
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    return graph


def _abandon(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that failed, so the stream leaves capture mode; the capture's own error is the one raised."""
    try:
        graph.capture_end()
    except RuntimeError:
        pass
