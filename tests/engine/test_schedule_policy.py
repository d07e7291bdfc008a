"""Admission order (--schedule-policy, Scheduler._order_waiting): fcfs admits waiting prompts in arrival order; sjf
the shortest first, except that a prompt that has waited AGED_STEPS steps keeps its place and retracted requests
come back first. The order changes when a request gets its first token, never which tokens it gets."""

from __future__ import annotations

from collections import deque

import pytest
from helpers import make_llm

from engine.test_mixed_schedule import greedy, prompts
from minisgl import LLM
from minisgl.core import Req
from minisgl.engine.config import EngineArgs
from minisgl.messages import AddReq
from minisgl.scheduler import scheduler as policy
from minisgl.server.args import parse_args

BUDGET = 256


def engine(path: str, order: str) -> LLM:
    llm = make_llm(path, max_prefill_tokens=BUDGET, max_running_requests=64, overlap_schedule=False)
    llm.scheduler.shortest_first = order == "sjf"
    return llm


def first_token_ticks(llm: LLM, arrivals: dict[int, list[Req]]) -> dict[int, int]:
    """Tick until every request finished, `arrivals[k]` added before tick k: the tick at which each request had its
    first token, by rid."""
    sched, at, tick = llm.scheduler, {}, 0
    while sched.has_work or tick <= max(arrivals):
        sched.tick([AddReq(r) for r in arrivals.get(tick, [])])
        progressed, finished = sched.take_outputs()
        for req in progressed + finished:
            at.setdefault(req.rid, tick)
        tick += 1
    return at


def burst(lengths: list[int], max_tokens: int = 3, first_rid: int = 0, seed: int = 1) -> list[Req]:
    return [Req(first_rid + i, p, greedy(max_tokens), seed=0) for i, p in enumerate(prompts(lengths, seed=seed))]


LENGTHS = [200, 40, 120, 60, 180, 20]  # 620 tokens together: three steps of a 256-token budget


@pytest.mark.parametrize("order", ["fcfs", "sjf"])
def test_a_burst_gets_its_first_tokens_in_the_policys_order_with_the_same_tokens(tiny_models, order):
    reqs = burst(LENGTHS)
    llm = engine(tiny_models["qwen3"], order)
    try:
        at = first_token_ticks(llm, {0: reqs})
    finally:
        llm.shutdown()
    ranked = sorted(reqs, key=(lambda r: len(r.prompt_ids)) if order == "sjf" else (lambda r: r.rid))
    ticks = [at[r.rid] for r in ranked]
    assert ticks == sorted(ticks) and ticks[0] < ticks[-1]
    # sjf: the four shortest (240 tokens) fit the first step; fcfs: only the first two arrivals (240) do
    assert sum(t == ticks[0] for t in ticks) == (4 if order == "sjf" else 2)
    llm = engine(tiny_models["qwen3"], "fcfs")
    try:  # the same prompts generated together, offline
        expected = [out.token_ids for out in llm.generate([r.prompt_ids for r in reqs], greedy(3))]
    finally:
        llm.shutdown()
    assert [r.output_ids for r in reqs] == expected and all(len(ids) == 3 for ids in expected)


@pytest.mark.parametrize("aged_steps", [4, 10**9])
def test_a_long_prompt_keeps_its_place_once_aged(tiny_models, monkeypatch, aged_steps):
    """A 200-token prompt arrives with nine 30-token ones, and nine more come before each of the next 20 ticks:
    shortest first, they fill every step's budget. Aged after 4 steps, the long prompt goes next; never aged, it
    waits until the short ones stop."""
    monkeypatch.setattr(policy, "AGED_STEPS", aged_steps)
    long = burst([200], max_tokens=1, first_rid=1000, seed=3)[0]
    arrivals = {k: burst([30] * 9, max_tokens=1, first_rid=10 * k, seed=k + 10) for k in range(21)}
    arrivals[0].insert(0, long)
    llm = engine(tiny_models["qwen3"], "sjf")
    try:
        at = first_token_ticks(llm, arrivals)
    finally:
        llm.shutdown()
    assert len(at) == 1 + 9 * 21
    if aged_steps == 4:
        assert at[long.rid] <= aged_steps + 2
    else:
        assert at[long.rid] > 20


def test_retracted_requests_then_aged_prompts_then_the_shortest(tiny_models):
    llm = engine(tiny_models["qwen3"], "sjf")
    try:
        sched = llm.scheduler
        sched.steps = 100
        fresh_long, fresh_short, aged_long, aged_longer, retracted = burst([90, 10, 80, 95, 50])
        for req in (fresh_long, fresh_short, retracted):
            req.queued_step = 100 - policy.AGED_STEPS + 1
        aged_long.queued_step, aged_longer.queued_step = 100 - policy.AGED_STEPS, 100 - policy.AGED_STEPS - 5
        retracted.output_ids = [7, 8]
        sched.waiting = deque([fresh_long, fresh_short, aged_long, aged_longer, retracted])
        sched._order_waiting()
        assert list(sched.waiting) == [retracted, aged_longer, aged_long, fresh_short, fresh_long]
    finally:
        llm.shutdown()


def test_the_policy_is_a_server_flag_shortest_first_on_a_server_arrival_order_offline(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.schedule_policy == "sjf"
    assert EngineArgs(tiny_models["qwen3"]).schedule_policy == "fcfs"
    assert parse_args(base + ["--schedule-policy", "fcfs"]).engine.schedule_policy == "fcfs"
    assert parse_args(base + ["--scheduling-policy", "fcfs"]).engine.schedule_policy == "fcfs"  # vLLM's spelling
    with pytest.raises(SystemExit):
        parse_args(base + ["--schedule-policy", "lpm"])  # SGLang's default, not served: a usage error
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineArgs(tiny_models["qwen3"], schedule_policy="priority")
