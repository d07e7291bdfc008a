"""Greedy output must equal transformers' generate token for token, whatever the engine settings."""

from __future__ import annotations

import pytest
from helpers import ARCHS, hf_greedy, make_llm, random_prompts

from minisgl import LLM, SamplingParams

LENGTHS = [1, 7, 19, 64, 130, 257, 310, 33]  # 8 prompts, 1 to 300+ tokens
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
VOCAB = 400  # below every tiny model's vocabulary

_reference: dict[str, list[list[int]]] = {}


def reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    key = f"{path}:{prompts[0][:4]}:{len(prompts)}"
    if key not in _reference:
        _reference[key] = hf_greedy(path, prompts, NEW_TOKENS)
    return _reference[key]


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


VARIANTS = {
    "page1": dict(page_size=1),
    "page16": dict(page_size=16),
    "chunk16": dict(max_prefill_tokens=16),
    "chunk16_page16_naive": dict(max_prefill_tokens=16, page_size=16, cache_type="naive"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(tiny_models, arch, variant):
    prompts = random_prompts(LENGTHS, VOCAB)
    llm = make_llm(tiny_models[arch], **VARIANTS[variant])
    outs = llm.generate(prompts, GREEDY)
    expected = reference(tiny_models[arch], prompts)
    for out, ref, prompt in zip(outs, expected, prompts):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.prompt_tokens == len(prompt)
    assert_no_leak(llm)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_radix_cache_shares_prefix(tiny_models, arch, page_size):
    shared = random_prompts([100], VOCAB, seed=1)[0]
    first = [shared + tail for tail in random_prompts([5, 9, 30], VOCAB, seed=2)]
    second = [shared + tail for tail in random_prompts([3, 12, 21, 40], VOCAB, seed=3)]
    llm = make_llm(tiny_models[arch], page_size=page_size)
    outs1 = llm.generate(first, GREEDY)
    assert all(o.cached_tokens == 0 for o in outs1)
    outs2 = llm.generate(second, GREEDY)
    shared_pages = len(shared) // page_size * page_size
    for out in outs2:
        assert shared_pages <= out.cached_tokens < out.prompt_tokens
    assert llm.stats()["cache_hit_tokens"] >= 4 * shared_pages
    for out, ref in zip(outs1 + outs2, reference(tiny_models[arch], first) + reference(tiny_models[arch], second)):
        assert out.token_ids == ref
    # A prompt seen before in full is served from cache but for its last token.
    again = llm.generate(second[:1], GREEDY)[0]
    assert again.cached_tokens >= len(second[0]) - page_size and again.token_ids == outs2[0].token_ids
    assert_no_leak(llm)


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_retraction_keeps_output(tiny_models, arch, cache_type):
    prompts = random_prompts([12, 40, 25, 33, 18, 9, 28, 37], VOCAB, seed=4)
    # 8 requests of up to 72 tokens in a pool of 120: decode must run out of pages and retract.
    llm = make_llm(tiny_models[arch], num_pages=120, cache_type=cache_type)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["num_retracted"] > 0
    assert [o.token_ids for o in outs] == reference(tiny_models[arch], prompts)
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_2_equals_1(tiny_models, arch):
    prompts = random_prompts(LENGTHS, VOCAB)
    with make_llm(tiny_models[arch], tp_size=2, max_prefill_tokens=64) as llm:
        tp2 = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        again = llm.generate(prompts[:2], GREEDY)  # the follower keeps serving between calls
        assert_no_leak(llm)
    tp1 = [o.token_ids for o in make_llm(tiny_models[arch]).generate(prompts, GREEDY)]
    assert tp2 == tp1 == reference(tiny_models[arch], prompts)
    assert [o.token_ids for o in again] == tp1[:2]
