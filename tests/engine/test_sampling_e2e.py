"""Sampling controls through the whole engine: seeds, stops, EOS, logprobs, limits, validation."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import hf_greedy, hf_logprobs, make_llm, random_prompts

from minisgl import LLM, SamplingParams

VOCAB = 400


@pytest.fixture(scope="module")
def qwen3(tiny_models) -> str:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return make_llm(qwen3, page_size=4)


def test_seeded_sampling_ignores_batch_composition(llm):
    target = random_prompts([23], VOCAB, seed=10)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    others = random_prompts([5, 60, 17, 2, 90], VOCAB, seed=11)
    other_params = [SamplingParams(temperature=t, max_tokens=m, seed=s, ignore_eos=True)
                    for t, m, s in [(1.0, 30, None), (0.0, 10, None), (0.7, 40, 5), (1.3, 3, None), (0.5, 24, 1234)]]
    mixed = llm.generate(others[:3] + [target] + others[3:], other_params[:3] + [params] + other_params[3:])
    assert mixed[3].token_ids == alone
    assert llm.generate([target], dataclasses.replace(params, seed=99))[0].token_ids != alone
    unseeded = [llm.generate([target], dataclasses.replace(params, seed=None))[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts([3, 40, 11], VOCAB, seed=12)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True, seed=3))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_a_temperature_too_small_for_float32_is_greedy(llm):
    """Found by schemathesis: 1e-38 divided the logits into inf and NaN, and the race drew token 0; below
    GREEDY_TEMPERATURE (vLLM's epsilon) a request samples greedily."""
    prompts = random_prompts([3, 40, 11], VOCAB, seed=13)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tiny = llm.generate(prompts, SamplingParams(temperature=1.2e-38, max_tokens=20, ignore_eos=True, seed=3))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_stop_token_ids_end_with_stop(llm, qwen3):
    prompt = random_prompts([30], VOCAB, seed=13)[0]
    ref = hf_greedy(qwen3, [prompt], 32)[0]
    stop = ref[6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: ref.index(stop) + 1]


def test_min_tokens_bans_stop_ids_until_reached(llm, qwen3):
    prompt = random_prompts([30], VOCAB, seed=13)[0]
    stop = hf_greedy(qwen3, [prompt], 32)[0][2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[stop]))[0]
    enders = [stop] + llm.engine.config.eos_token_ids
    assert len(out.token_ids) >= 12 and not set(enders) & set(out.token_ids[:11])
    assert out.finish_reason == ("stop" if out.token_ids[-1] in enders else "length")


def test_generation_config_eos_ids_stop(tmp_path, qwen3):
    """Every id in generation_config.json's eos_token_id stops generation, unless ignore_eos."""
    prompt = random_prompts([25], VOCAB, seed=14)[0]
    ref = hf_greedy(qwen3, [prompt], 32)[0]
    model = tmp_path / "eos_model"
    shutil.copytree(qwen3, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, ref[9]]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = make_llm(str(model))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(ref[9]) + 1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == ref


def test_logprobs_match_transformers(llm, qwen3):
    prompts = random_prompts([9, 70], VOCAB, seed=15)
    params = [SamplingParams(temperature=0.8, max_tokens=12, seed=4, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)]
    for prompt, param, out in zip(prompts, params, llm.generate(prompts, params)):
        ref = hf_logprobs(qwen3, prompt, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
            top = torch.topk(ref[step], param.logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0].logprobs is None


def test_max_seq_len_caps_generation(qwen3):
    llm = make_llm(qwen3, max_seq_len=64)
    out = llm.generate(random_prompts([50], VOCAB)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 14
    with pytest.raises(ValueError, match="64"):
        llm.generate(random_prompts([64], VOCAB)[0])


def test_text_prompts_use_the_tokenizer(llm):
    out = llm.generate("Hello, world!", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_tokens == len(llm.tokenizer("Hello, world!")["input_ids"])
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"), ([1, 10**6], "token ids"), ("", "empty"),
])
def test_bad_prompts_raise(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt])
    stats = llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 100),
    ("stop_token_ids", [-1]), ("seed", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logprobs", -1), ("ignore_eos", "yes"),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
