"""Overlap scheduling's races, each forced to happen, and fault isolation of a single request.

With overlap the scheduler launches step N before it reads step N-1, so a request can finish, be
aborted, fail or be retracted while a step that contains it is still in flight. Each test checks that
the race really occurred, that the outputs equal a run without overlap, and that every page is back.
"""

from __future__ import annotations

import pytest
from conftest import make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req, ReqStatus
from minisgl.scheduler import AbortReq, AddReq

VOCAB = 400


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def pages_idle(llm: LLM) -> bool:
    stats = llm.stats()
    return not llm.scheduler.has_work and stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


def reclaimable(llm: LLM) -> int:
    stats = llm.stats()
    return stats["free_pages"] + stats["evictable_pages"]


def run_all(llm: LLM, reqs: list[Req], on_step=None) -> dict[int, Req]:
    """Drive the scheduler step by step until every request finished; on_step(llm) after each step."""
    llm.scheduler.sync_and_apply([AddReq(r) for r in reqs])
    done: dict[int, Req] = {}
    while llm.scheduler.has_work:
        llm.scheduler.step()
        if on_step:
            on_step(llm)
        done.update((r.rid, r) for r in llm.scheduler.finished)
        llm.scheduler.finished.clear()
    return done


def fresh(reqs: list[Req]) -> list[Req]:
    return [Req(r.rid, list(r.prompt_ids), r.params, r.seed) for r in reqs]


@pytest.fixture(scope="module")
def engines(tiny_models):
    """The same model twice: overlap on and off."""
    path = tiny_models["qwen3"]
    return (make_llm(path, page_size=4, max_prefill_tokens=32),
            make_llm(path, page_size=4, max_prefill_tokens=32, overlap_schedule=False))


def test_finish_while_next_step_in_flight(engines):
    overlap, plain = engines
    prompts = random_prompts([7, 12, 5], VOCAB, seed=5)
    free_run = plain.generate(prompts, greedy(12))
    stop = free_run[0].token_ids[4]  # request 0 stops at its first `stop`, others run on
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]), greedy(12), greedy(12)]
    reqs = [Req(i, p, sp, seed=0) for i, (p, sp) in enumerate(zip(prompts, params))]
    raced = []

    def watch(llm: LLM) -> None:
        step = llm.scheduler.in_flight
        raced.extend(r.rid for r in llm.scheduler.finished if step and r in step.batch.reqs)

    got = run_all(overlap, fresh(reqs), watch)
    want = run_all(plain, fresh(reqs))
    assert 0 in raced, "request 0 should finish while a step containing it is in flight"
    assert got[0].finish_reason == "stop" and got[0].output_ids[-1] == stop
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert all(r.in_flight == 0 for r in got.values())
    assert pages_idle(overlap)


def test_abort_while_token_in_flight(engines):
    overlap, plain = engines
    prompts = random_prompts([9, 6, 11], VOCAB, seed=6)
    reqs = [Req(10 + i, p, greedy(10), seed=0) for i, p in enumerate(prompts)]
    seen = {}

    def abort_when_in_flight(llm: LLM) -> None:
        victim = llm.scheduler.reqs.get(11)
        if victim is not None and victim.in_flight and len(victim.output_ids) >= 2:
            seen["in_flight"] = victim.in_flight
            before = reclaimable(llm)
            llm.scheduler.sync_and_apply([AbortReq(11)])
            seen["freed"] = reclaimable(llm) > before

    got = run_all(overlap, fresh(reqs), abort_when_in_flight)
    want = run_all(plain, fresh(reqs))
    assert seen["in_flight"] == 1 and seen["freed"], "the abort should free pages while a token is in flight"
    assert got[11].finish_reason == "abort" and 2 <= len(got[11].output_ids) < 10
    assert got[11].output_ids == want[11].output_ids[: len(got[11].output_ids)]  # the late token was dropped
    assert [got[i].output_ids for i in (10, 12)] == [want[i].output_ids for i in (10, 12)]
    assert pages_idle(overlap)


def test_retraction_during_overlapped_step(tiny_models):
    path = tiny_models["qwen3"]
    kw = dict(page_size=4, num_pages=24, max_prefill_tokens=64)
    overlap, plain = make_llm(path, **kw), make_llm(path, overlap_schedule=False, **kw)
    reqs = [Req(20 + i, p, greedy(30), seed=0) for i, p in enumerate(random_prompts([10, 14, 9, 12], VOCAB, seed=7))]
    retracted_in_flight = []
    retract = overlap.scheduler._retract

    def watched_retract(req: Req) -> None:  # observe, then do the real thing
        if req.in_flight:
            retracted_in_flight.append(req.rid)
        retract(req)

    overlap.scheduler._retract = watched_retract
    got = run_all(overlap, fresh(reqs))
    want = run_all(plain, fresh(reqs))
    assert overlap.stats()["num_retracted"] > 0 and retracted_in_flight
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert all(len(r.output_ids) == 30 and r.finish_reason == "length" for r in got.values())
    assert pages_idle(overlap)


@pytest.mark.parametrize("overlap", [True, False])
def test_one_failing_request_does_not_stop_the_others(tiny_models, overlap):
    """A request that slipped past validation (stop id 2**70 with min_tokens: the sampler cannot
    pack it) fails alone, with its error; the batch around it is unaffected."""
    llm = make_llm(tiny_models["qwen3"], page_size=4, overlap_schedule=overlap)
    prompts = random_prompts([8, 5, 13, 6], VOCAB, seed=8)
    want = llm.generate(prompts, greedy(9))
    bad = greedy(9, min_tokens=1)
    bad.stop_token_ids = [2**70]  # set after validation, as a missed check would let through
    reqs = [Req(30 + i, p, bad if i == 2 else greedy(9), seed=0) for i, p in enumerate(prompts)]
    got = run_all(llm, reqs)
    assert got[32].status is ReqStatus.FINISHED and got[32].finish_reason == "abort"
    assert got[32].error and "Overflow" in got[32].error
    assert [got[30 + i].output_ids for i in (0, 1, 3)] == [want[i].token_ids for i in (0, 1, 3)]
    assert pages_idle(llm)
    assert llm.generate(prompts[0], greedy(9))[0].token_ids == want[0].token_ids  # still serving
