"""Burst splitting (Scheduler._burst_room): beside fewer decodes than the cost ratio needs, prompts that wait
together are cut into steps of StepCost.burst_room's size, so the first of them get their first token before the
last is computed, as long as every decode a cut step stalls has a stall left (one at admission and one per
STALL_TOKENS tokens); otherwise a step takes the whole budget. Off (the offline default), a burst takes the whole
budget.

Each step's batch is read where the scheduler hands it to the (real) engine, with COST as its step cost model.
"""

from __future__ import annotations

from engine.test_mixed_schedule import COST, drive, engine, greedy, prompts, record_batches, split
from minisgl import LLM
from minisgl.core import Batch, Req
from minisgl.scheduler import scheduler as policy
from minisgl.scheduler.scheduler import PREFILL_FLOOR

BUDGET = 1024


def burst_engine(path: str, on: bool = True) -> LLM:
    """An engine with COST as its step cost model and burst splitting `on` (the scheduler's MIN_TIMED_DECODES
    kept: every step here has fewer decodes)."""
    llm = engine(path, max_prefill_tokens=BUDGET, max_running_requests=32)
    llm.engine.step_cost, llm.scheduler.burst_split = COST, on
    return llm


def burst_steps(batches: list[Batch], burst: list[Req]) -> list[tuple[int, int, int, int]]:
    """Per batch carrying chunks of the `burst`'s prompts (all waiting before the first): (decodes, cached tokens
    they read, prefill tokens, prompt tokens left before it)."""
    left, steps = sum(len(r.prompt_ids) for r in burst), []
    for b in batches:
        if any(r in b.reqs and b.extend_lens[b.reqs.index(r)] > 1 for r in burst):
            decodes, kv, prefill = split(b)
            steps.append((decodes, kv, prefill, left))
            left -= prefill
    assert left == 0
    return steps


def cut_to(decodes: int, kv: int, lengths: list[int], left: int) -> int:
    """The prefill tokens of a step cut by burst_room when prompts of `lengths` have `left` tokens left."""
    queue = list(lengths)
    while sum(queue) > left:
        queue[0] -= min(queue[0], sum(queue) - left)
        queue = queue if queue[0] else queue[1:]
    return max(PREFILL_FLOOR, COST.burst_room(queue, decodes, kv, BUDGET - decodes))


def run_burst(path: str, on: bool) -> tuple[list[Batch], list[Req]]:
    """Twelve prompts of 100 tokens at once, nothing else running (so no stall earned)."""
    llm = burst_engine(path, on)
    burst = [Req(i, p, greedy(4), seed=0) for i, p in enumerate(prompts([100] * 12))]
    try:
        batches = record_batches(llm)
        drive(llm, burst)
    finally:
        llm.shutdown()
    return batches, burst


def test_a_burst_is_cut_into_steps_of_burst_rooms_size_while_its_decodes_have_stalls_left(tiny_models):
    """The first step stalls nobody and is cut; a later one is cut only if none of its decodes (the burst's first
    prompts, four tokens each: none earns a second stall) was stalled before, else it takes the whole budget."""
    batches, burst = run_burst(tiny_models["qwen3"], on=True)
    stalled, left, kinds = set(), 1200, []
    for b in batches:
        decodes, kv, prefill = split(b)
        if not prefill:
            continue
        whole, cut = min(left, BUDGET - decodes), cut_to(decodes, kv, [100] * 12, left)
        decoding = {r.rid for r, n in zip(b.reqs, b.extend_lens) if n == 1}
        if cut < whole and not decoding & stalled:
            assert prefill == cut
            stalled |= decoding
            kinds.append("cut")
        else:
            assert prefill == whole
            kinds.append("whole" if cut < whole else "rest")
        left -= prefill
    assert left == 0 and kinds[0] == "cut" and kinds.count("cut") >= 2  # the first prompts' stalls spent too
    sampled = [{b.reqs[i].rid for i in b.sampled} for b in batches]
    first, last = (next(k for k, rids in enumerate(sampled) if r.rid in rids) for r in (burst[0], burst[-1]))
    assert first < last  # the first prompt's first token was sampled before the last prompt was computed
    assert [len(r.output_ids) for r in burst] == [4] * 12 and max(r.stalls for r in burst) == 1


def test_without_burst_split_a_burst_takes_the_whole_budget(tiny_models):
    batches, burst = run_burst(tiny_models["qwen3"], on=False)
    assert [prefill for _, _, prefill, _ in burst_steps(batches, burst)] == [BUDGET, 1200 - BUDGET]


def test_cut_steps_spend_stalls_the_decodes_earned(tiny_models, monkeypatch):
    """Ten streams decode, each earning a stall every 16 tokens (the scheduler's STALL_TOKENS made small), when
    eight prompts of 300 tokens come after their seventh token: the first step is cut and spends their stall, so
    the next takes the whole budget although burst_room would still cut it; prompts coming once a stall is earned
    again are cut again."""
    monkeypatch.setattr(policy, "STALL_TOKENS", 16)
    llm = burst_engine(tiny_models["qwen3"])
    short = [Req(i, p, greedy(90), seed=0) for i, p in enumerate(prompts([5, 7, 6, 8, 5, 9, 4, 6, 7, 5]))]
    lengths, late_lengths = [300] * 8, [300] * 3
    burst = [Req(10 + i, p, greedy(4), seed=0) for i, p in enumerate(prompts(lengths, seed=1))]
    late = [Req(20 + i, p, greedy(4), seed=0) for i, p in enumerate(prompts(late_lengths, seed=2))]
    try:
        batches = record_batches(llm)
        drive(llm, short, arrivals={8: burst, 60: late})
    finally:
        llm.shutdown()
    steps = burst_steps([b for b in batches if not any(r in b.reqs for r in late)], burst)
    (decodes, kv, prefill, left), after = steps[0], steps[1]
    assert decodes == 10 and prefill == cut_to(decodes, kv, lengths, left) < left  # cut, spending the ten stalls
    decodes, kv, prefill, left = after
    assert cut_to(decodes, kv, lengths, left) < min(left, BUDGET - decodes) == prefill  # burst_room alone would cut
    decodes, kv, prefill, left = burst_steps([b for b in batches if any(r in b.reqs for r in late)], late)[0]
    assert decodes >= 10 and prefill == cut_to(decodes, kv, late_lengths, left) < left  # earned again: cut again
    assert all(len(r.output_ids) == 90 for r in short)
