"""Overlap scheduling's races, each forced to happen, and fault isolation of a single request.

With overlap the scheduler launches step N before it reads step N-1, so a request can finish, be
aborted, fail or be retracted while a step that contains it is still in flight. Each test checks that
the race really occurred, that the outputs equal a run without overlap, and that every page is back.

Constrained requests (grammars) overlap too: their batch's forward pass is enqueued before the previous
step is read, and sampling, with the masks, after. The same races, with a grammar, come last.
"""

from __future__ import annotations

import re
import threading

import pytest
from helpers import make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.constrained.grammar import COMPILE_THREADS
from minisgl.core import Constraint, Req, ReqStatus
from minisgl.messages import AbortReq, AddReq

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
    """Drive the scheduler tick by tick until every request finished; on_step(llm) after each tick."""
    llm.scheduler.sync_and_apply([AddReq(r) for r in reqs])
    done: dict[int, Req] = {}
    while llm.scheduler.has_work:
        llm.scheduler.tick([])  # with the grammars compiled since the last one
        if on_step:
            on_step(llm)
        done.update((r.rid, r) for r in llm.scheduler.take_outputs()[1])
    return done


def fresh(reqs: list[Req]) -> list[Req]:
    return [Req(r.rid, list(r.prompt_ids), r.params, r.seed) for r in reqs]


# Constrained requests: their steps overlap too, and meet the same races.
EMAIL = r"[a-z]{3,6}@example\.(com|org)"
LETTERS = r"(ab|cd|ef)[a-z]{30,50}\."  # the tiny model takes 20-30 tokens to write it


def constrained(regex: str, max_tokens: int = 80, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, constraint=Constraint("regex", regex), **kw)


def follows(llm: LLM, req: Req, regex: str) -> bool:
    """The request ended because its grammar did, and its text matches the grammar's regex."""
    text = llm.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    return req.finish_reason == "stop" and req.output_ids[-1] in llm.engine.config.eos_token_ids \
        and re.fullmatch(regex, text) is not None


def all_returned(llm: LLM) -> bool:
    """Pages, table and sampler rows, matchers and compilations: nothing is held once every request ended."""
    grammars = llm.scheduler.grammars
    return (pages_idle(llm) and len(llm.scheduler.kv.free_rows) == llm.engine.args.max_running_requests
            and not llm.engine.sampler.needs_random and not grammars.matchers and not grammars.compiling)


def overlapped_constrained(llm: LLM) -> bool:
    """The step just launched samples a constrained request and has not been read (it overlaps the next)."""
    step = llm.scheduler.unread_step
    return step is not None and any(step.batch.reqs[i].params.constraint for i in step.batch.sampled)


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
        step = llm.scheduler.unread_step
        raced.extend(r.rid for r in llm.scheduler.finished if step and r in step.batch.reqs)

    got = run_all(overlap, fresh(reqs), watch)
    want = run_all(plain, fresh(reqs))
    assert 0 in raced, "request 0 should finish while a step containing it is in flight"
    assert got[0].finish_reason == "stop" and got[0].output_ids[-1] == stop
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert all(r.unseen_tokens == 0 for r in got.values())
    assert pages_idle(overlap)


def test_generate_returns_with_the_engine_idle(engines):
    """A stop id cannot be foreseen, so the step after the last token is already launched when generate()'s
    last request stops: generate() reads it before returning, leaving the engine idle, as without overlap."""
    overlap, plain = engines
    prompt = random_prompts([8], VOCAB, seed=11)[0]
    stop = plain.generate(prompt, greedy(12))[0].token_ids[4]
    out = overlap.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert overlap.scheduler.unread_step is None and pages_idle(overlap)


def test_abort_while_token_in_flight(engines):
    overlap, plain = engines
    prompts = random_prompts([9, 6, 11], VOCAB, seed=6)
    reqs = [Req(10 + i, p, greedy(10), seed=0) for i, p in enumerate(prompts)]
    seen = {}

    def abort_when_in_flight(llm: LLM) -> None:
        victim = llm.scheduler.reqs.get(11)
        if victim is not None and victim.unseen_tokens and len(victim.output_ids) >= 2:
            seen["in_flight"] = victim.unseen_tokens
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


@pytest.mark.parametrize("with_grammar", [False, True])
def test_retraction_during_overlapped_step(tiny_models, with_grammar):
    path = tiny_models["qwen3"]
    kw = dict(page_size=4, num_pages=24, max_prefill_tokens=64)
    overlap, plain = make_llm(path, **kw), make_llm(path, overlap_schedule=False, **kw)
    params = constrained(LETTERS) if with_grammar else greedy(30)
    reqs = [Req(20 + i, p, params, seed=0) for i, p in enumerate(random_prompts([10, 14, 9, 12], VOCAB, seed=7))]
    retracted_in_flight = []
    retract = overlap.scheduler._retract

    def watched_retract(req: Req) -> None:  # observe, then do the real thing
        if req.unseen_tokens:
            retracted_in_flight.append(req.rid)
        retract(req)

    overlap.scheduler._retract = watched_retract
    got = run_all(overlap, fresh(reqs))
    want = run_all(plain, fresh(reqs))
    assert overlap.stats()["num_retracted"] > 0 and retracted_in_flight
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    if with_grammar:
        assert all(follows(overlap, r, LETTERS) for r in got.values()) and all_returned(overlap)
    else:
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

@pytest.mark.parametrize("ending", ["grammar", "stop", "length"])
def test_constrained_request_finishes_while_its_next_forward_is_enqueued(engines, ending):
    """Step N ends a constrained request that step N+1's forward pass already computes: N+1's token for it is
    dropped, its matcher released, and its mask row left open (the batch's other rows keep their masks)."""
    overlap, plain = engines
    prompts = random_prompts([7, 12, 5, 20], VOCAB, seed=9)
    regex = EMAIL if ending == "grammar" else LETTERS
    first = constrained(regex)
    if ending == "stop":
        first = constrained(regex, stop_token_ids=[plain.generate(prompts[0], first)[0].token_ids[6]])
    elif ending == "length":
        first = constrained(regex, max_tokens=9)
    reqs = [Req(50 + i, p, first if i == 0 else constrained(regex), seed=0) for i, p in enumerate(prompts)]
    raced, overlapped = [], []

    def watch(llm: LLM) -> None:
        step = llm.scheduler.unread_step
        raced.extend(r.rid for r in llm.scheduler.finished if step and r in step.batch.reqs)
        if any(r.params.constraint for r in llm.scheduler.running):
            overlapped.append(overlapped_constrained(llm))

    got = run_all(overlap, fresh(reqs), watch)
    want = run_all(plain, fresh(reqs))
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert sum(overlapped) > len(overlapped) // 2, "constrained steps should overlap"
    if ending == "length":  # its last token is never followed by a step: nothing to race
        assert got[50].finish_reason == "length" and len(got[50].output_ids) == 9
    else:
        assert 50 in raced, "request 50 should finish while the next step's forward pass holds it"
        assert got[50].finish_reason == "stop" and got[50].output_ids[-1] in first.stop_token_ids + [
            *overlap.engine.config.eos_token_ids]
    assert all(follows(overlap, got[i], regex) for i in (51, 52, 53))
    assert all(r.unseen_tokens == 0 for r in got.values()) and all_returned(overlap)


def test_abort_constrained_request_while_its_token_is_in_flight(engines):
    overlap, plain = engines
    prompts = random_prompts([9, 6, 11], VOCAB, seed=10)
    reqs = [Req(60 + i, p, constrained(LETTERS), seed=0) for i, p in enumerate(prompts)]
    seen = {}

    def abort_when_in_flight(llm: LLM) -> None:
        victim = llm.scheduler.reqs.get(61)
        if victim is not None and victim.unseen_tokens and len(victim.output_ids) >= 3 and overlapped_constrained(llm):
            seen["in_flight"] = victim.unseen_tokens
            before = reclaimable(llm)
            llm.scheduler.sync_and_apply([AbortReq(61)])
            seen["freed"] = reclaimable(llm) > before
            seen["matcher_released"] = 61 not in llm.scheduler.grammars.matchers

    got = run_all(overlap, fresh(reqs), abort_when_in_flight)
    want = run_all(plain, fresh(reqs))
    assert seen == {"in_flight": 1, "freed": True, "matcher_released": True}
    assert got[61].finish_reason == "abort" and 3 <= len(got[61].output_ids) < len(want[61].output_ids)
    assert got[61].output_ids == want[61].output_ids[: len(got[61].output_ids)]  # the late token was dropped
    assert [got[i].output_ids for i in (60, 62)] == [want[i].output_ids for i in (60, 62)]
    assert follows(overlap, got[60], LETTERS) and follows(overlap, got[62], LETTERS)
    assert all_returned(overlap)


def test_batches_mixing_constrained_and_free_requests_overlap(engines):
    """Free requests' tokens are those they get alone; constrained ones (greedy and seeded sampling) those of a
    run without overlap, and they follow their grammars."""
    overlap, plain = engines
    prompts = random_prompts([5, 17, 9, 30, 12, 7], VOCAB, seed=11)
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=80, constraint=Constraint("regex", LETTERS))
    params = [greedy(24), constrained(EMAIL), greedy(20), constrained(LETTERS), sampled, greedy(30)]
    reqs = [Req(70 + i, p, sp, seed=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    mixed = []

    def watch(llm: LLM) -> None:
        step = llm.scheduler.unread_step
        if step is not None:
            kinds = {step.batch.reqs[i].params.constraint is None for i in step.batch.sampled}
            mixed.append(kinds == {True, False})

    got = run_all(overlap, fresh(reqs), watch)
    want = run_all(plain, fresh(reqs))
    alone = run_all(overlap, fresh([r for r in reqs if r.params.constraint is None]))
    assert any(mixed), "some overlapped step should sample free and constrained requests together"
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert {i: got[i].output_ids for i in alone} == {i: r.output_ids for i, r in alone.items()}
    assert follows(overlap, got[71], EMAIL) and follows(overlap, got[73], LETTERS) and follows(overlap, got[74],
                                                                                                LETTERS)
    assert all_returned(overlap)


def test_free_requests_overlap_while_a_grammar_compiles(engines):
    """A grammar held in compilation keeps its request aside; the free requests' steps go on overlapped, and
    the constrained request joins them once it compiled."""
    overlap, plain = engines
    regex = r"[a-z]{4}-[0-9]{4}"  # used by no other test: not in the compiled-grammar cache
    prompts = random_prompts([8, 13, 6], VOCAB, seed=13)
    reqs = [Req(90, prompts[0], greedy(40), seed=0), Req(91, prompts[1], greedy(40), seed=0),
            Req(92, prompts[2], constrained(regex), seed=0)]
    overlap.generate(prompts[0], constrained(EMAIL))  # the first constrained request creates the grammars
    gate = threading.Event()
    for _ in range(COMPILE_THREADS):  # occupy every compilation thread until the gate opens
        overlap.scheduler.grammars.pool.submit(gate.wait)
    scheduler = overlap.scheduler
    scheduler.sync_and_apply([AddReq(r) for r in fresh(reqs)])
    for _ in range(6):
        scheduler.tick([])
        assert [r.rid for r in scheduler.compiling] == [92] and (scheduler.unread_step or scheduler.pending)
    progressed_while_compiling = {r.rid: len(r.output_ids) for r in scheduler.running}
    gate.set()
    got = {r.rid: r for r in scheduler.take_outputs()[1]}
    got.update(run_all(overlap, []))
    want = run_all(plain, fresh(reqs))
    assert all(n > 0 for n in progressed_while_compiling.values()) and len(progressed_while_compiling) == 2
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    assert follows(overlap, got[92], regex) and all_returned(overlap)


def test_prompt_scoring_in_an_overlapped_constrained_batch(engines):
    """Prompts scored in chunks (32 tokens a step) in batches whose sampling waits for the previous step."""
    overlap, plain = engines
    prompts = random_prompts([45, 20, 70], VOCAB, seed=14)
    params = [constrained(EMAIL, prompt_logprobs=2), greedy(12, prompt_logprobs=1), constrained(LETTERS)]
    reqs = [Req(100 + i, p, sp, seed=0) for i, (p, sp) in enumerate(zip(prompts, params))]
    scored_in_overlap = []

    def watch(llm: LLM) -> None:
        step = llm.scheduler.unread_step
        scored_in_overlap.append(overlapped_constrained(llm) and bool(step.batch.scored))

    got = run_all(overlap, fresh(reqs), watch)
    want = run_all(plain, fresh(reqs))
    assert any(scored_in_overlap)
    assert {i: r.output_ids for i, r in got.items()} == {i: r.output_ids for i, r in want.items()}
    for i in (100, 101):
        assert len(got[i].prompt_logprobs) == len(got[i].prompt_ids) - 1
        assert [(p.token_id, [t for t, _ in p.top]) for p in got[i].prompt_logprobs] == \
            [(p.token_id, [t for t, _ in p.top]) for p in want[i].prompt_logprobs]
        assert [p.logprob for p in got[i].prompt_logprobs] == pytest.approx([p.logprob for p in
                                                                             want[i].prompt_logprobs], abs=1e-4)
    assert follows(overlap, got[100], EMAIL) and follows(overlap, got[102], LETTERS) and all_returned(overlap)
