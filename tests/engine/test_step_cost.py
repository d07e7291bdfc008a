"""The step cost model (engine/step_cost.py): a step's device time from the timed buckets, the most prefill
tokens a step can carry beside its decodes within a ratio of their cost, and the step size that gets a burst of
prompts their first tokens soonest on average (against a brute-force search over every step size)."""

from __future__ import annotations

import math
import random

import pytest

from minisgl.engine.config import EngineArgs
from minisgl.engine.step_cost import StepCost
from minisgl.server.args import parse_args

COST = StepCost(tokens=(16, 64, 256), linear_ms=(1.0, 1.0, 3.0), kv_ms_per_token=0.001)


@pytest.mark.parametrize("tokens,ms", [(1, 1.0), (16, 1.0), (40, 1.0), (64, 1.0), (160, 2.0), (256, 3.0),
                                       (448, 5.0), (1216, 13.0)])
def test_cost_is_flat_below_the_first_bucket_interpolated_between_and_extrapolated_past_the_last(tokens, ms):
    assert COST.ms(tokens) == pytest.approx(ms)


def test_decode_attention_adds_its_cached_tokens():
    assert COST.ms(64, kv_tokens=2000) == pytest.approx(1.0 + 2.0)


@pytest.mark.parametrize("decodes,kv,ratio", [(16, 0, 2.0), (16, 0, 3.0), (64, 5000, 2.0), (200, 100_000, 1.5)])
def test_prefill_room_is_the_largest_chunk_within_the_ratio(decodes, kv, ratio):
    room = COST.prefill_room(decodes, kv, ratio, limit=100_000)
    allowed = ratio * COST.ms(decodes, kv)
    assert COST.ms(decodes + room, kv) <= allowed + 1e-9 < COST.ms(decodes + room + 1, kv)


def test_prefill_room_grows_with_what_the_decodes_already_cost_and_stops_at_the_limit():
    few, busy = COST.prefill_room(16, 0, 3.0, 8192), COST.prefill_room(16, 200_000, 3.0, 8192)
    assert few == 240 and busy > few  # 3 ms allowed: 256 tokens in all; busy decodes read 200k cached tokens
    assert COST.prefill_room(16, 10**7, 3.0, 8192) == 8192


# Shapes of a step's cost: flat then linear (COST), straight past a launch-bound floor (qwen3-8b on an H100 by the
# issue's figures), steeper with size, flatter with size, and one bucket (cost proportional to the tokens past it).
SHAPES = {"flat-then-linear": StepCost((16, 64, 256, 512), (1.0, 1.0, 2.0, 3.0), 0.001),
          "h100-8b": StepCost((16, 256, 1024), (7.0, 12.0, 29.0), 0.0001),
          "convex": StepCost((16, 128, 512, 2048), (1.0, 1.2, 3.0, 15.0), 0.001),
          "concave": StepCost((16, 128, 512, 2048), (1.0, 3.0, 5.0, 9.0), 0.001),
          "one-bucket": StepCost((64,), (2.0,), 0.0)}


def mean_first_token_ms(cost: StepCost, lengths: list[int], step: int, decodes: int, kv: int) -> float:
    """Prompts of `lengths`, all waiting, computed in order in steps of `step` tokens beside `decodes` decodes
    reading `kv` cached tokens: the mean time at which each prompt's last token is computed."""
    clock, done, i, left = 0.0, [], 0, list(lengths)
    while i < len(left):
        room, finished = step, 0
        while i < len(left) and room:
            n = min(left[i], room)
            left[i], room = left[i] - n, room - n
            if not left[i]:
                i, finished = i + 1, finished + 1
        clock += cost.ms(decodes + step - room, kv)
        done += [clock] * finished
    return sum(done) / len(done)


def mean_token_ms(cost: StepCost, backlog: int, step: int, decodes: int, kv: int) -> float:
    """mean_first_token_ms of `backlog` one-token prompts (a burst of many small prompts), in closed form per step."""
    clock, total = 0.0, 0.0
    for taken in range(0, backlog, step):
        n = min(step, backlog - taken)
        clock += cost.ms(decodes + n, kv)
        total += n * clock
    return total / backlog


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backlog", [10, 300, 2000, 10_000, 40_000])
@pytest.mark.parametrize("decodes,kv", [(0, 0), (20, 20_000)])
def test_burst_room_is_within_two_percent_of_the_best_step_size(shape, backlog, decodes, kv):
    cost, limit = SHAPES[shape], 8192 - decodes
    room = cost.burst_room(backlog, decodes, kv, limit)
    best = min(mean_token_ms(cost, backlog, step, decodes, kv) for step in range(1, limit + 1))
    assert 1 <= room <= min(limit, backlog)
    assert mean_token_ms(cost, backlog, room, decodes, kv) <= 1.02 * best


@pytest.mark.parametrize("backlog", [500, 10_000, 40_000])
def test_on_a_straight_cost_burst_room_is_the_square_root_rule(backlog):
    """a + p*s a step: s* = sqrt(B*a/p)."""
    cost = StepCost((16, 1024), (7.0, 29.0), 0.0)
    p = 22.0 / 1008
    assert cost.burst_room(backlog, 0, 0, 8192) == pytest.approx(math.sqrt(backlog * (7.0 - 16 * p) / p), abs=1)


@pytest.mark.parametrize("seed", range(4))
def test_burst_room_serves_the_issues_burst_of_sixteen_prompts(seed):
    """Sixteen prompts of 256-1,024 tokens at once on qwen3-8b's shape: within 6% of the best step size for their
    mean time to first token (whole prompts make it a step function: the formula counts tokens), and at least 15%
    sooner than steps of the whole 8,192-token budget."""
    cost, rng = SHAPES["h100-8b"], random.Random(seed)
    lengths = [rng.randrange(256, 1025) for _ in range(16)]
    room = cost.burst_room(sum(lengths), 0, 0, 8192)
    mean = mean_first_token_ms(cost, lengths, room, 0, 0)
    assert mean <= 1.06 * min(mean_first_token_ms(cost, lengths, step, 0, 0) for step in range(16, 8193, 4))
    assert mean <= 0.85 * mean_first_token_ms(cost, lengths, 8192, 0, 0)


def test_the_server_cuts_bursts_unless_told(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.burst_split
    assert not parse_args(base + ["--disable-burst-split"]).engine.burst_split
    assert not EngineArgs(tiny_models["qwen3"]).burst_split  # offline: throughput first


def test_the_server_keeps_mixed_steps_within_two_decode_steps_unless_told(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.max_mixed_step_ratio == 2.0
    assert parse_args(base + ["--max-mixed-step-ratio", "0"]).engine.max_mixed_step_ratio == 0
    assert EngineArgs(tiny_models["qwen3"]).max_mixed_step_ratio == 0  # offline: throughput first
    with pytest.raises(ValueError, match="max_mixed_step_ratio"):
        EngineArgs(tiny_models["qwen3"], max_mixed_step_ratio=0.5)  # below 1 not even a decode step fits
