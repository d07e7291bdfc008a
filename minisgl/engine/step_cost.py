"""What one step costs on the device, measured at start-up, so the scheduler can size a step's prefill chunks
by time rather than by tokens alone (Scheduler._prefill_room).

A step's device time has two parts that matter at the sizes served:
- everything but attention (projections, MLP or MoE, norms, logits of the last rows), which depends only on
  the step's token count: timed per token-count bucket by replaying the whole-step CUDA graphs with
  all-padding attention metadata, whose attention programs exit at once (engine/whole_graph.py; their launches,
  a few microseconds a layer, are counted), interpolated between buckets and extrapolated past the last one
  along the slope of the upper half of the buckets (device-bound, where the cost grows linearly; one pair's slope
  is timing noise: qwen3-8b's last two on an H100 gave 69 us a token, its served steps of 3,000-8,000 tokens 23.5);
- decode attention, which reads every cached K/V of every decoding request once: the cached tokens times the
  pool's bytes per token, over the device's copy bandwidth (timed too). At 256 streams of ~1,000 tokens on
  qwen3-0.6b that is ~8 ms of a ~13 ms step, so leaving it out would make a busy decode step look cheap
  and squeeze the prefill chunks beside it for nothing.
Prefill attention (quadratic in a chunk, but a few percent of its projections at chunks of ~1,000 tokens) is
left out. The figures are a model for a budget, not a promise: the ratio the scheduler keeps is approximate.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from minisgl.core import Batch

COPY_BYTES = 128 << 20  # the buffer timed for the copy bandwidth
REPEATS = 3  # replays (copies) per timing, enqueued back to back so the device, not the host, sets the pace


@dataclass(frozen=True)
class StepCost:
    tokens: tuple[int, ...]  # token counts timed, ascending
    linear_ms: tuple[float, ...]  # the step's cost without attention at each, non-decreasing
    kv_ms_per_token: float  # reading one cached token's K and V of every layer once

    def ms(self, tokens: int, kv_tokens: int = 0) -> float:
        """Estimated device time of a step of `tokens` tokens whose decodes read `kv_tokens` cached tokens."""
        return self._linear(tokens) + kv_tokens * self.kv_ms_per_token

    def batch_ms(self, batch: Batch) -> float:
        """Estimated device time of `batch`'s step: all its tokens, and the cached tokens its decodes read."""
        return self.ms(sum(batch.extend_lens), batch.decode_kv_tokens)

    def _linear(self, tokens: int) -> float:
        xs, ys = self.tokens, self.linear_ms
        if tokens <= xs[0]:  # the smallest bucket is about the floor of any step
            return ys[0]
        if len(xs) == 1:
            return ys[0] * tokens / xs[0]
        if tokens > xs[-1]:  # along the upper half of the buckets
            k = min(bisect.bisect_left(xs, xs[-1] / 2), len(xs) - 2)
            return ys[-1] + (ys[-1] - ys[k]) / (xs[-1] - xs[k]) * (tokens - xs[-1])
        i = bisect.bisect_left(xs, tokens)  # interpolate on [i-1, i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]) * (tokens - xs[i - 1])

    def prefill_room(self, decodes: int, kv_tokens: int, ratio: float, limit: int) -> int:
        """The most prefill tokens (at most `limit`) a step with `decodes` decodes reading `kv_tokens` cached
        tokens can carry while it costs at most `ratio` times the decode step alone."""
        allowed = ratio * self.ms(decodes, kv_tokens)
        low, high = 0, limit  # ms() grows with tokens: the largest count within `allowed`, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if self.ms(decodes + mid, kv_tokens) <= allowed:
                low = mid
            else:
                high = mid - 1
        return low


def measure(replay: Callable[[int], None], buckets: list[int], kv_bytes_per_token: int,
            device: torch.device, agree_max: Callable[[int], int]) -> StepCost:
    """Time each bucket's graphs (`replay(tokens)` enqueues one replay) and the device's copy bandwidth. Every
    tensor-parallel rank must schedule alike, so the ranks agree on each figure (the slowest rank's, in
    microseconds: `agree_max`)."""
    linear, worst = [], 0.0
    for tokens in buckets:
        worst = max(worst, agree_max(round(1000 * _device_ms(partial(replay, tokens)))) / 1000)
        linear.append(worst)  # timing noise must not make a larger step look cheaper
    copy_us = agree_max(round(1000 * _copy_ms(device)))
    bytes_per_ms = 2 * COPY_BYTES / (max(copy_us, 1) / 1000)  # a copy reads and writes each byte
    return StepCost(tuple(buckets), tuple(linear), kv_bytes_per_token / bytes_per_ms)


def _device_ms(run: Callable[[], object]) -> float:
    """Device time of one `run()`, in ms: the mean of REPEATS enqueued back to back."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(REPEATS):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / REPEATS


def _copy_ms(device: torch.device) -> float:
    """One device-to-device copy of COPY_BYTES, in ms (after one untimed)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = partial(dst.copy_, src)
    copy()
    ms = _device_ms(copy)
    del src, dst, copy
    torch.cuda.empty_cache()
    return ms
