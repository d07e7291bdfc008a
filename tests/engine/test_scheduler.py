"""Scheduler life cycles driven step by step: aborts at every stage, caps, and page accounting."""

from __future__ import annotations

import pytest
from helpers import make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req, ReqStatus
from minisgl.messages import AbortReq, AddReq

VOCAB = 400


def pages_accounted(llm: LLM) -> None:
    """Every page is free, cached or owned by exactly one running request; none twice."""
    sched = llm.scheduler
    free = sched.kv.allocator.free_pages
    owned = [p for req in sched.running for p in req.pages]
    assert len(set(free)) == len(free), "a page was freed twice"
    assert not set(free) & set(owned), "a running request owns a free page"
    stats = llm.stats()
    if not sched.running:
        assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]
    assert stats["free_pages"] + stats["cached_pages"] <= stats["total_pages"]


@pytest.fixture
def llm(tiny_models) -> LLM:
    return make_llm(tiny_models["qwen2"], page_size=4, max_prefill_tokens=16,
               max_running_requests=3)


def submit(llm: LLM, lengths: list[int], max_tokens: int = 20) -> list[Req]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [Req(100 + i, p, params, seed=0) for i, p in enumerate(random_prompts(lengths, VOCAB, seed=20))]
    llm.scheduler.sync_and_apply([AddReq(r) for r in reqs])
    return reqs


def run(llm: LLM, steps: int) -> None:
    for _ in range(steps):
        llm.scheduler.step()
        pages_accounted(llm)
        assert len(llm.scheduler.running) <= llm.engine.args.max_running_requests


def test_abort_at_every_stage_frees_pages_once(llm):
    sched = llm.scheduler
    prefilling, decoding, waiting, *rest = submit(llm, [50, 6, 8, 9, 10])
    run(llm, 1)  # budget 16: 16 tokens of the 50-token prompt; nothing else fits
    assert prefilling.status is ReqStatus.RUNNING and 0 < prefilling.kv_len < prefilling.seq_len - 1
    sched.sync_and_apply([AbortReq(prefilling.rid)])
    pages_accounted(llm)
    run(llm, 3)
    assert decoding.status is ReqStatus.RUNNING and decoding.output_ids
    assert waiting.status is ReqStatus.RUNNING
    assert rest[-1].status is ReqStatus.WAITING  # max_running_requests=3
    sched.sync_and_apply([AbortReq(decoding.rid), AbortReq(rest[-1].rid), AbortReq(decoding.rid), AbortReq(12345)])
    pages_accounted(llm)
    while sched.has_work:
        run(llm, 1)
    finished = {r.rid: r for r in sched.finished}
    assert [finished[r.rid].finish_reason for r in (prefilling, decoding, rest[-1])] == ["abort"] * 3
    assert finished[waiting.rid].finish_reason == "length" and len(waiting.output_ids) == 20
    assert len(sched.finished) == 5  # the double abort and the unknown id did nothing
    pages_accounted(llm)


def test_running_cap_and_fifo_admission(llm):
    reqs = submit(llm, [5, 5, 5, 5, 5, 5], max_tokens=4)
    order = []
    while llm.scheduler.has_work:
        run(llm, 1)
        order += [r.rid for r in llm.scheduler.finished if r.rid not in order]
    assert order == [r.rid for r in reqs]


def test_retraction_under_pressure_accounts_pages(tiny_models):
    llm = make_llm(tiny_models["qwen2"], page_size=4, num_pages=24)
    reqs = submit(llm, [10, 14, 9, 12], max_tokens=30)
    while llm.scheduler.has_work:
        run(llm, 1)
    assert llm.stats()["num_retracted"] > 0
    assert all(len(r.output_ids) == 30 and r.finish_reason == "length" for r in reqs)
    pages_accounted(llm)


def test_request_larger_than_pool_is_rejected(tiny_models):
    llm = make_llm(tiny_models["qwen2"], page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="KV pool holds only 32"):
        llm.generate(random_prompts([40], VOCAB)[0])
    # A prompt that fits but whose generation outgrows the pool stops with "length", not a hang.
    out = llm.generate(random_prompts([20], VOCAB)[0], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and 20 + len(out.token_ids) >= 32
    pages_accounted(llm)


def test_request_that_can_never_fit_finishes_instead_of_hanging(tiny_models):
    """The offline front rejects such prompts; the scheduler must not hang on one that gets through."""
    llm = make_llm(tiny_models["qwen2"], page_size=4, num_pages=8)
    too_big, fine = submit(llm, [40, 6], max_tokens=3)
    for _ in range(10):
        run(llm, 1)
    assert too_big.finish_reason == "length" and too_big.output_ids == []
    assert fine.finish_reason == "length" and len(fine.output_ids) == 3
    pages_accounted(llm)


def test_finished_requests_release_their_sampler_rows(tiny_models):
    """After sampled requests leave, greedy batches no longer pay for random sampling."""
    llm = make_llm(tiny_models["qwen2"])
    llm.generate(random_prompts([5, 9], VOCAB), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=1))
    assert not llm.engine.sampler.needs_random
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    reqs = [Req(200, random_prompts([6], VOCAB)[0], params, seed=0)]
    llm.scheduler.sync_and_apply([AddReq(r) for r in reqs])
    run(llm, 2)
    assert llm.engine.sampler.needs_random  # a running sampled request does need it
    llm.scheduler.sync_and_apply([AbortReq(200)])
    assert not llm.engine.sampler.needs_random


def test_warm_up_leaves_no_trace(tiny_models):
    """The GPU warm-up's prefills of every size class (run here on the CPU) leave the cache empty, every page
    free, the counters at zero, and the engine answering exactly as an engine that never warmed up."""
    prompts = random_prompts([5, 40, 130], 400, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with make_llm(tiny_models["qwen3_moe"], num_pages=8192, max_prefill_tokens=1024) as cold:
        want = cold.generate(prompts, params)
    with make_llm(tiny_models["qwen3_moe"], num_pages=8192, max_prefill_tokens=1024) as warm:
        warm.scheduler.warm_up((4, 24, 96, 384, 768, 1536))  # 1536 exceeds the prefill budget: left out
        stats = warm.stats()
        assert stats["cached_pages"] == 0 and stats["free_pages"] == stats["total_pages"]
        assert stats["prompt_tokens_admitted"] == stats["cache_hit_tokens"] == stats["num_retracted"] == 0
        assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in want]


def test_tp2_warm_up_empties_every_ranks_cache(tiny_models):
    """With TP=2 the followers' prefix caches are emptied too: a prompt that starts like the warm-up's would
    otherwise hit on rank 1 and not on rank 0, and the ranks would run different batches."""
    prompt = [list(range(30))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with make_llm(tiny_models["qwen3"], tp_size=2) as tp2:
        tp2.scheduler.warm_up((4, 24))
        got = tp2.generate(prompt, params)
    with make_llm(tiny_models["qwen3"]) as tp1:
        assert [o.token_ids for o in got] == [o.token_ids for o in tp1.generate(prompt, params)]
    assert got[0].cached_tokens == 0
