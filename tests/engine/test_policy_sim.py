"""benchmarks/policy_sim.py: the modelled clock is the sum of the modelled steps the real scheduler took, and the
closed loop sends a stream's next request when its last one ends."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

from minisgl import LLM
from minisgl.engine.step_cost import StepCost
from minisgl.scheduler import scheduler as policy
from minisgl.server.args import parse_args

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from policy_sim import read_cost, repeated_rows, run_levels, simulate  # noqa: E402

ONE_MS = StepCost((1, 8192), (1.0, 1.0), 0.0)


def run(path: str, streams: int, overlap: bool = False, **args) -> dict:
    """One simulated level on a fresh engine with an 8-token budget, every step 1 ms (ONE_MS)."""
    llm = LLM(path, device="cpu", dtype="float32", num_pages=1024, max_prefill_tokens=8, overlap_schedule=overlap)
    try:
        return simulate(llm, ONE_MS, streams, Namespace(seed=0, **args))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prefill_error, admit_ms", [(1.0, 0.0), (2.0, 0.0), (1.0, 0.5)])
def test_a_stream_of_two_requests_on_a_one_ms_step(tiny_models, prefill_error, admit_ms):
    """Every step costs 1 ms (a step with prompt tokens `prefill_error` ms). A 20-token prompt under an 8-token
    budget reaches the scheduler `admit_ms` after it is sent and takes three steps (8, 8, 4) to its first token,
    then three decodes; the second request is sent as the first ends and goes the same way."""
    row = run(tiny_models["qwen3"], 1, prompt_len=(20, 20), rounds=2, max_tokens=4, prefill_error=prefill_error,
              admit_ms=admit_ms)
    request_ms = admit_ms + 3 * prefill_error + 3
    assert row["ttft_p50"] == row["ttft_p99"] == admit_ms + 3 * prefill_error
    assert (row["queue_mean"], row["prefill_mean"]) == (admit_ms, 3 * prefill_error)  # the server's two stages
    assert row["itl_p50"] == row["itl_p99"] == 1.0
    assert row["tok_s"] == pytest.approx(1000 * 8 / (2 * request_ms))


def test_requests_sent_together_are_admitted_one_at_a_time(tiny_models):
    """Two streams send 4-token prompts at once, one token each; the API admits them 5 ms apart: the first reaches
    the scheduler at 5 ms and has its token at 6, the second reaches an idle scheduler at 10 and has it at 11."""
    row = run(tiny_models["qwen3"], 2, prompt_len=(4, 4), rounds=1, max_tokens=1, prefill_error=1.0, admit_ms=5.0)
    assert (row["ttft_p50"], row["ttft_p99"]) == (6.0, 11.0)
    assert (row["queue_mean"], row["prefill_mean"]) == (7.5, 1.0)  # each scheduled as it reaches the scheduler
    assert row["tok_s"] == pytest.approx(1000 * 2 / 11)


@pytest.mark.parametrize("overlap", [False, True])
def test_with_overlap_a_step_is_built_while_the_one_before_runs(tiny_models, overlap):
    """Two streams send 4-token prompts for two tokens each; the API admits them 0.5 ms apart, so B reaches the
    scheduler at 1.0 ms, while A's prefill (0.5-1.5) runs. Without overlap the next step is built when A's prefill
    is read (1.5): A's decode and B's prefill (1.5-2.5), then B's decode: first tokens at 1.5 and 2.5, the last
    token at 3.5. With overlap the step after A's prefill was built at 0.5, before B arrived: A's decode alone
    (1.5-2.5); B is scheduled at 1.5 and runs 2.5-3.5, its decode 3.5-4.5: first tokens at 1.5 and 3.5, B's
    prefill stage (scheduled to first token) 2 ms, the last token at 4.5."""
    row = run(tiny_models["qwen3"], 2, overlap, prompt_len=(4, 4), rounds=1, max_tokens=2, prefill_error=1.0,
              admit_ms=0.5)
    b_first, last = (3.5, 4.5) if overlap else (2.5, 3.5)
    assert (row["ttft_p50"], row["ttft_p99"]) == (1.5, b_first)
    assert (row["queue_mean"], row["prefill_mean"]) == (1.0, (1.0 + b_first - 1.5) / 2)
    assert row["tok_s"] == pytest.approx(1000 * 4 / last)


def test_the_stored_step_cost_models_read_back_whole():
    """Each stored H100 model: as many token counts as times, the counts ascending, the times never falling (the
    engine keeps them so), a cached token's cost positive."""
    for path in sorted((BENCHMARKS / "step_costs").glob("*.txt")):
        cost = read_cost(str(path))
        assert len(cost.tokens) == len(cost.linear_ms) > 1, path
        assert list(cost.tokens) == sorted(set(cost.tokens)), path
        assert list(cost.linear_ms) == sorted(cost.linear_ms), path
        assert 0 < cost.kv_ms_per_token < 1e-3, path


def test_on_one_server_a_light_level_meets_the_load_the_heavy_one_left(tiny_models, monkeypatch):
    """--burst-split, 100-token steps for a light burst: four streams of 100-token prompts on a fresh scheduler get
    their first tokens over four steps; after forty streams on the same one (its window of recent load still holds
    them) the four prompts go in one step, so the median first token comes sooner. The forty-stream level is the
    same either way: it starts each run."""
    monkeypatch.setattr(policy, "BURST_CHUNK_TOKENS", 100)
    monkeypatch.setattr(policy, "BURST_MIN_MS", 0.5)  # a step is 1 ms here
    path = tiny_models["qwen3"]
    server = parse_args(["--model", path, "--device", "cpu", "--burst-split"]).engine
    args = dict(seed=0, prompt_len=(100, 100), rounds=1, max_tokens=4, prefill_error=1.0, admit_ms=0.0,
                kv_tokens=None)
    fresh, shared = (list(run_levels(path, server, ONE_MS, [40, 4], Namespace(one_server=one, **args)))
                     for one in (False, True))
    assert fresh[0] == shared[0]
    assert (fresh[1]["ttft_p50"], fresh[1]["ttft_p99"]) == (3.0, 4.0)  # one prompt a step
    assert (shared[1]["ttft_p50"], shared[1]["ttft_p99"]) == (1.0, 1.0)  # all four in the first step


def test_the_simulated_scheduler_admits_in_the_servers_order(tiny_models):
    """Six prompts of 4-40 tokens sent at once under a 16-token budget, one token each: with --schedule-policy sjf
    the median first token comes sooner than in arrival order, and the last one (all the prompt tokens computed) at
    the same time."""
    path = tiny_models["qwen3"]
    args = Namespace(seed=0, prompt_len=(4, 40), rounds=1, max_tokens=1, prefill_error=1.0, admit_ms=0.0,
                     one_server=False, kv_tokens=None)
    fcfs, sjf = (next(run_levels(path, parse_args(["--model", path, "--device", "cpu", "--max-num-batched-tokens",
                                                   "16", "--schedule-policy", order]).engine, ONE_MS, [6], args))
                 for order in ("fcfs", "sjf"))
    assert sjf["ttft_p50"] < fcfs["ttft_p50"]
    assert sjf["ttft_p99"] == fcfs["ttft_p99"] and sjf["tok_s"] == fcfs["tok_s"]


def test_a_level_larger_than_the_kv_capacity_waits_for_pages(tiny_models):
    """--kv-tokens: four streams of 100-token prompts, four tokens each, on a one-ms step. With room for all, every
    first token comes after the first step. With 250 tokens of K/V only two requests fit (104 tokens each): the
    other two are admitted when those finish at 4 ms, get their first tokens at 5 and their last at 8."""
    path = tiny_models["qwen3"]
    server = parse_args(["--model", path, "--device", "cpu"]).engine
    rows = [next(run_levels(path, server, ONE_MS, [4], Namespace(
        seed=0, prompt_len=(100, 100), rounds=1, max_tokens=4, prefill_error=1.0, admit_ms=0.0, one_server=False,
        kv_tokens=kv_tokens))) for kv_tokens in (None, 250)]
    assert [(r["ttft_p99"], r["queue_mean"]) for r in rows] == [(1.0, 0.0), (5.0, 2.0)]
    assert [r["tok_s"] for r in rows] == [pytest.approx(1000 * 16 / 4), pytest.approx(1000 * 16 / 8)]


def test_repeats_run_each_level_with_its_own_seed_then_a_median_row(tiny_models):
    """--repeats 3 on two levels: each run's rows are the levels' rows of a single run with seed 5, 6 and 7 (prompts
    of their own), in run order; then one row per level whose figures are the median run's."""
    path = tiny_models["qwen3"]
    server = parse_args(["--model", path, "--device", "cpu", "--max-num-batched-tokens", "16"]).engine
    args = dict(prompt_len=(4, 40), rounds=2, max_tokens=3, prefill_error=1.0, admit_ms=0.0, kv_tokens=None,
                one_server=False)
    rows = list(repeated_rows(path, server, ONE_MS, [2, 3], Namespace(seed=5, repeats=3, **args)))
    singles = [list(run_levels(path, server, ONE_MS, [2, 3], Namespace(seed=seed, **args))) for seed in (5, 6, 7)]
    assert [(r["streams"], r["repeat"]) for r in rows] == [
        (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2), (2, "median"), (3, "median")]
    assert rows[:6] == [{**row, "repeat": k} for k, single in enumerate(singles) for row in single]
    assert len({single[0]["ttft_p50"] for single in singles}) > 1  # the seeds drew different prompts
    for level, median in enumerate(rows[6:]):
        ttfts = sorted(single[level]["ttft_p99"] for single in singles)
        assert median["ttft_p99"] == round(ttfts[1], 2)
