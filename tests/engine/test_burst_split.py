"""Burst splitting (--burst-split, Scheduler._light_burst): under a light load (fewer than MIN_TIMED_DECODES
requests held at each of the last LIGHT_LOAD_STEPS steps), a burst of at most two token budgets of prompts that
would take longer than BURST_MIN_MS whole (by the step cost model) is computed in steps of BURST_CHUNK_TOKENS, so
its first prompts get their first token before its last is computed; a larger burst, a quicker one, or one soon
after a heavier load, takes the whole budget. Off (the offline LLM's default), a burst takes the whole budget.

Each step's batch is read where the scheduler hands it to the (real) engine.
"""

from __future__ import annotations

import pytest
from helpers import make_llm

from engine.test_mixed_schedule import drive, greedy, prompts, record_batches
from minisgl import LLM
from minisgl.core import Batch, Req
from minisgl.engine.step_cost import StepCost
from minisgl.scheduler import scheduler as policy

BUDGET = 1024
CHUNK = 256  # BURST_CHUNK_TOKENS here, a quarter of the budget as on a server (3,072 of 8,192 there)
TOKEN_MS = StepCost((1, 8192), (1.0, 8192.0), 0.0)  # 1 ms a token: any part of the bursts below is over BURST_MIN_MS


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(policy, "BURST_CHUNK_TOKENS", CHUNK)


def burst_engine(path: str, on: bool = True, cost: StepCost | None = TOKEN_MS) -> LLM:
    """An engine whose scheduler cuts bursts (`on`) and models a step's device time by `cost` (the CPU measures
    none)."""
    llm = make_llm(path, max_prefill_tokens=BUDGET, max_running_requests=64)
    llm.scheduler.burst_split, llm.engine.step_cost = on, cost
    return llm


def prefill_steps(batches: list[Batch], reqs: list[Req]) -> list[int]:
    """The prompt tokens of `reqs` each batch computes, for the batches computing any."""
    steps = [sum(n for r, n in zip(b.reqs, b.extend_lens) if r in reqs and n > 1) for b in batches]
    return [n for n in steps if n]


def run(path: str, burst: list[Req], on: bool = True, first: list[Req] = (), arrive_at: int = 0,
        cost: StepCost | None = TOKEN_MS) -> list[Batch]:
    """The batches of a run: `first` from the start, then `burst` before tick `arrive_at`."""
    llm = burst_engine(path, on, cost)
    try:
        batches = record_batches(llm)
        if arrive_at:
            drive(llm, list(first), arrivals={arrive_at: burst})
        else:
            drive(llm, burst)
    finally:
        llm.shutdown()
    return batches


def burst_of(lengths: list[int], first_rid: int = 0) -> list[Req]:
    return [Req(first_rid + i, p, greedy(4), seed=0) for i, p in enumerate(prompts(lengths, seed=1))]


def test_a_light_burst_is_computed_in_chunks_its_first_prompts_first_and_with_the_same_tokens(tiny_models):
    path = tiny_models["qwen3"]
    burst = burst_of([100] * 12)
    batches = run(path, burst)
    assert prefill_steps(batches, burst) == [CHUNK] * 4 + [1200 - 4 * CHUNK]
    sampled = [{b.reqs[i].rid for i in b.sampled} for b in batches]
    first, last = (next(k for k, rids in enumerate(sampled) if r.rid in rids) for r in (burst[0], burst[-1]))
    assert first < last  # the first prompt's first token was sampled before the last prompt was computed
    whole = burst_of([100] * 12)
    run(path, whole, on=False)
    assert [r.output_ids for r in burst] == [r.output_ids for r in whole] and all(len(r.output_ids) == 4 for r in burst)


def test_without_burst_split_a_burst_takes_the_whole_budget(tiny_models):
    burst = burst_of([100] * 12)
    assert prefill_steps(run(tiny_models["qwen3"], burst, on=False), burst) == [BUDGET, 1200 - BUDGET]


@pytest.mark.parametrize("cost", [StepCost((1, 8192), (0.04, 327.68), 0.0), None], ids=["48_ms_whole", "no_model"])
def test_a_burst_quick_to_compute_whole_takes_the_whole_budget(tiny_models, cost):
    """At 0.04 ms a token the 1,200-token burst takes 48 ms whole, within BURST_MIN_MS: cutting it would stall the
    running streams for little. Without a step cost model nothing says how long it takes: not cut either."""
    burst = burst_of([100] * 12)
    assert prefill_steps(run(tiny_models["qwen3"], burst, cost=cost), burst) == [BUDGET, 1200 - BUDGET]


def test_a_burst_of_more_than_two_budgets_takes_the_whole_budget_until_two_are_left(tiny_models):
    """3,000 prompt tokens: the first step takes the budget (1,976 left, within two budgets), later ones chunks
    beside the decodes of the prompts done by then."""
    burst = burst_of([100] * 30)
    steps = prefill_steps(run(tiny_models["qwen3"], burst), burst)
    assert steps[0] == BUDGET and steps[1:] == [CHUNK] * 7 + [3000 - BUDGET - 7 * CHUNK]


@pytest.mark.parametrize("window,cut", [(512, False), (4, True)])
def test_a_burst_soon_after_a_heavy_load_takes_the_whole_budget(tiny_models, monkeypatch, window, cut):
    """Forty short requests (at least MIN_TIMED_DECODES held) finish by the tenth tick; one long request then decodes
    alone until the burst comes at tick 24. The server's window of 512 steps still holds the heavy load: whole
    budget. A window of 4 steps holds only the light one: the burst is cut."""
    monkeypatch.setattr(policy, "LIGHT_LOAD_STEPS", window)
    heavy = [Req(i, p, greedy(6), seed=0) for i, p in enumerate(prompts([5] * 40))]
    lone = Req(99, prompts([5], seed=2)[0], greedy(60), seed=0)
    burst = burst_of([100] * 12, first_rid=100)
    batches = run(tiny_models["qwen3"], burst, first=[*heavy, lone], arrive_at=24)
    assert max(len(b.reqs) for b in batches) >= policy.MIN_TIMED_DECODES
    assert all(len(r.output_ids) == 6 for r in heavy) and len(lone.output_ids) == 60
    assert prefill_steps(batches, burst)[0] == (CHUNK if cut else BUDGET - 1)  # beside the lone decode
