"""The step cost model (engine/step_cost.py): a step's device time from the timed buckets, the most prefill
tokens a step can carry beside its decodes within a ratio of their cost, and the scheduling flags' defaults."""

from __future__ import annotations

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


def test_a_server_cuts_bursts_unless_told_not_to_and_the_offline_llm_does_not(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.burst_split
    assert parse_args(base + ["--burst-split"]).engine.burst_split
    assert not parse_args(base + ["--no-burst-split"]).engine.burst_split
    assert not EngineArgs(tiny_models["qwen3"]).burst_split


def test_the_server_bounds_mixed_steps_at_three_decode_steps_under_a_backlog_unless_told(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.max_mixed_step_ratio == 3.0
    assert parse_args(base + ["--max-mixed-step-ratio", "0"]).engine.max_mixed_step_ratio == 0
    assert EngineArgs(tiny_models["qwen3"]).max_mixed_step_ratio == 0  # offline: throughput first
    with pytest.raises(ValueError, match="max_mixed_step_ratio"):
        EngineArgs(tiny_models["qwen3"], max_mixed_step_ratio=0.5)  # below 1 not even a decode step fits
