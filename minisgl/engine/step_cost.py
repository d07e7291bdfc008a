"""What one step costs on the device, measured at start-up, so the scheduler can size a step's prefill chunks
by time rather than by tokens alone (Scheduler._prefill_room).

A step's device time has two parts that matter at the sizes served:
- everything but attention (projections, MLP or MoE, norms, logits of the last rows), which depends only on
  the step's token count: timed per token-count bucket by replaying the piecewise CUDA graphs, which hold
  exactly that part (engine/piecewise_graph.py), interpolated between buckets and extrapolated past the
  last one along its slope (the last bucket is device-bound, where the cost grows linearly);
- decode attention, which reads every cached K/V of every decoding request once: the cached tokens times the
  pool's bytes per token, over the device's copy bandwidth (timed too). At 256 streams of ~1,000 tokens on
  qwen3-0.6b that is ~8 ms of a ~13 ms step, so leaving it out would make a busy decode step look cheap
  and squeeze the prefill chunks beside it for nothing.
Prefill attention (quadratic in a chunk, but a few percent of its projections at chunks of ~1,000 tokens) is
left out. The figures are a model for a budget, not a promise: the ratio the scheduler keeps is approximate.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

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

    def _linear(self, tokens: int) -> float:
        xs, ys = self.tokens, self.linear_ms
        if tokens <= xs[0]:  # the smallest bucket is about the floor of any step
            return ys[0]
        if len(xs) == 1:
            return ys[0] * tokens / xs[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)  # interpolate on [i-1, i]; past the end, extrapolate
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + slope * (tokens - xs[i - 1])

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

    def burst_room(self, backlog_tokens: int, decodes: int, kv_tokens: int, limit: int) -> int:
        """The prefill tokens a step beside `decodes` decodes reading `kv_tokens` cached tokens should take from
        `backlog_tokens` prompt tokens that all wait now, so that their first tokens come soonest on average; at
        most `limit` and the backlog (Scheduler._burst_room).

        In steps of s tokens the backlog's B tokens finish on average after (B/s + 1) / 2 steps of ms(decodes + s)
        each. Where the model is a line a + p*s (between two buckets, or past the last), that is least at
        s = sqrt(B*a/p): smaller steps finish the first prompts sooner, but each step pays `a` again. So the best
        of that point on each piece (clamped to it) and the pieces' ends. Below the first bucket the model is
        flat, so no step smaller than the bucket is chosen: it would cost as much and only add steps."""
        def twice_mean_ms(step: int) -> float:
            return self.ms(decodes + step, kv_tokens) * (backlog_tokens / step + 1)

        top = max(1, min(limit, backlog_tokens))
        ends = sorted({t - decodes for t in self.tokens if 1 < t - decodes < top} | {1, top})
        steps = set(ends)
        for low, high in zip(ends, ends[1:]):
            slope = (self.ms(decodes + high, kv_tokens) - self.ms(decodes + low, kv_tokens)) / (high - low)
            fixed = self.ms(decodes + low, kv_tokens) - slope * low  # the piece's line at no prefill
            if slope > 0 and fixed > 0:
                steps.add(min(high, max(low, round(math.sqrt(backlog_tokens * fixed / slope)))))
        return min(sorted(steps), key=twice_mean_ms)


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
