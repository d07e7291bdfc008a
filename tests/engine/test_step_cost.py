"""The step cost model (engine/step_cost.py): a step's device time from the timed buckets, the most prefill
tokens a step can carry beside its decodes within a ratio of their cost, and the step size that gets a burst of
prompts their first tokens soonest on average (against a brute-force search over every step size)."""

from __future__ import annotations

import itertools
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


def test_past_the_last_bucket_the_cost_follows_the_upper_half_of_the_buckets():
    """A noisy top pair (10 -> 14 ms over the last 100 tokens) must not set the slope: from 1,000 tokens on it is
    the one from the first bucket at half the last's tokens, (14 - 6) / (1,000 - 500) ms a token."""
    noisy = StepCost(tokens=(100, 500, 900, 1000), linear_ms=(2.0, 6.0, 10.0, 14.0), kv_ms_per_token=0.0)
    assert noisy.ms(2000) == pytest.approx(14.0 + 1000 * 8.0 / 500)
    assert noisy.ms(950) == pytest.approx(12.0)  # inside, the neighbours as before


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


def mean_first_token_ms(cost: StepCost, lengths: list[int], steps: list[int], decodes: int, kv: int) -> float:
    """Prompts of `lengths`, all waiting, computed in order in steps of `steps` tokens (the last size repeated)
    beside `decodes` decodes reading `kv` cached tokens: the mean time at which each prompt's last token is
    computed."""
    clock, done, left = 0.0, [], list(lengths)
    for k in itertools.count():
        if not left:
            return sum(done) / len(done)
        room = size = steps[min(k, len(steps) - 1)]
        finished = 0
        while left and room:
            n = min(left[0], room)
            left[0], room = left[0] - n, room - n
            if not left[0]:
                left.pop(0)
                finished += 1
        clock += cost.ms(decodes + size - room, kv)
        done += [clock] * finished


def boundary_plans(lengths: list[int]) -> list[list[int]]:
    """Every way to compute the prompts in steps that each end where a prompt ends."""
    plans = []
    for cuts in itertools.product([False, True], repeat=len(lengths) - 1):
        plan, step = [], 0
        for n, cut in zip(lengths, [*cuts, True]):
            step += n
            if cut:
                plan, step = plan + [step], 0
        plans.append(plan)
    return plans


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("decodes,kv", [(0, 0), (20, 20_000)])
def test_burst_room_starts_the_best_plan_of_steps_ending_at_prompt_ends(shape, seed, decodes, kv):
    """Against every such plan (all 2^(n-1) of up to 8 prompts), whatever the cost's shape."""
    rng = random.Random(seed)
    lengths = [rng.randrange(16, 1200) for _ in range(rng.randrange(1, 9))]
    cost = SHAPES[shape]
    plans = boundary_plans(lengths)
    best = min(mean_first_token_ms(cost, lengths, plan, decodes, kv) for plan in plans)
    room = cost.burst_room(lengths, decodes, kv, 8192)
    assert min(mean_first_token_ms(cost, lengths, plan, decodes, kv) for plan in plans
               if plan[0] == room) == pytest.approx(best)


def replanned(cost: StepCost, lengths: list[int]) -> list[int]:
    """The steps the prompts take when each is sized anew by burst_room, as the scheduler does."""
    left, steps = list(lengths), []
    while left:
        step = cost.burst_room(left, 0, 0, 8192)
        steps.append(step)
        while step:
            n = min(left[0], step)
            left[0], step = left[0] - n, step - n
            if not left[0]:
                left.pop(0)
    return steps


@pytest.mark.parametrize("shape", [name for name in SHAPES if name != "convex"])
@pytest.mark.parametrize("seed", range(4))
def test_where_cost_grows_at_most_linearly_no_fixed_step_size_beats_it(shape, seed):
    """Against steps of every size from 1 token to the whole backlog, kept throughout."""
    rng = random.Random(seed)
    lengths = [rng.randrange(16, 1200) for _ in range(rng.randrange(2, 12))]
    cost = SHAPES[shape]
    fixed = min(mean_first_token_ms(cost, lengths, [step], 0, 0) for step in range(1, sum(lengths) + 1))
    assert mean_first_token_ms(cost, lengths, replanned(cost, lengths), 0, 0) <= fixed + 1e-9


@pytest.mark.parametrize("shape", [name for name in SHAPES if name != "convex"])
@pytest.mark.parametrize("length", [40, 700, 3000, 20_000])
def test_one_prompt_is_never_cut_below_the_limit(shape, length):
    """Its first token waits for its last chunk: cutting it only adds steps."""
    assert SHAPES[shape].burst_room([length], 0, 0, 8192) == min(length, 8192)


@pytest.mark.parametrize("seed", range(4))
def test_burst_room_serves_the_issues_burst_of_sixteen_prompts(seed):
    """Sixteen prompts of 256-1,024 tokens at once on qwen3-8b's shape: their first tokens at least 15% sooner on
    average than in steps of the whole 8,192-token budget, when each step is planned anew (as the scheduler does)."""
    cost, rng = SHAPES["h100-8b"], random.Random(seed)
    lengths = [rng.randrange(256, 1025) for _ in range(16)]
    steps = replanned(cost, lengths)
    assert len(steps) > 2
    assert mean_first_token_ms(cost, lengths, steps, 0, 0) <= 0.85 * mean_first_token_ms(cost, lengths, [8192], 0, 0)


def test_bursts_are_cut_only_when_asked(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert not parse_args(base).engine.burst_split
    assert parse_args(base + ["--burst-split"]).engine.burst_split
    assert not EngineArgs(tiny_models["qwen3"]).burst_split


def test_the_server_bounds_mixed_steps_at_four_decode_steps_under_a_backlog_unless_told(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.max_mixed_step_ratio == 4.0
    assert parse_args(base + ["--max-mixed-step-ratio", "0"]).engine.max_mixed_step_ratio == 0
    assert EngineArgs(tiny_models["qwen3"]).max_mixed_step_ratio == 0  # offline: throughput first
    with pytest.raises(ValueError, match="max_mixed_step_ratio"):
        EngineArgs(tiny_models["qwen3"], max_mixed_step_ratio=0.5)  # below 1 not even a decode step fits
