"""Prompt logprobs (for `echo` and vLLM's prompt_logprobs): every prompt token's log-probability equals
transformers', whatever the chunking, a prefix already in the cache, or a retraction; and `echo` on
/v1/completions through the real server and the `openai` client."""

from __future__ import annotations

import openai
import pytest
import torch
from helpers import DEVICE, hf_model, make_llm, random_prompts
from server_fixtures import Server
from transformers import AutoTokenizer

from minisgl import SamplingParams


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at positions 0..P-2: row i predicts prompt token i+1."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt], device=DEVICE)).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).cpu()


@pytest.fixture(scope="module")
def path(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.mark.parametrize("chunk", [7, 64])
def test_prompt_logprobs_equal_transformers_in_chunks_and_after_a_cache_hit(path, chunk):
    prompts = random_prompts([23, 9, 40], 500, seed=chunk)
    with make_llm(path, max_prefill_tokens=chunk, page_size=4) as llm:
        llm.generate([p[:20] for p in prompts], SamplingParams(temperature=0, max_tokens=2))  # prefixes cached
        params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in (0, 2, 5)]
        outs = llm.generate(prompts, params)
        plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    for prompt, out, again, k in zip(prompts, outs, plain, (0, 2, 5)):
        expected = hf_prompt_logprobs(path, prompt)
        assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs])
        assert torch.allclose(got, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4)
        for row, entry in zip(expected, out.prompt_logprobs):
            top = row.topk(k)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in entry.top]), top.values, atol=1e-4)
        assert out.cached_tokens == 0 and again.cached_tokens > 0  # scoring skipped the cache; others use it
        assert out.token_ids == again.token_ids and again.prompt_logprobs is None


def test_prompt_logprobs_survive_a_retraction(path):
    """A pool too small for both: one is retracted and recomputed; its scores are kept once, not twice."""
    prompts = random_prompts([60, 60], 500, seed=3)
    with make_llm(path, max_prefill_tokens=16, num_pages=100) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1))
        assert llm.stats()["num_retracted"] > 0
    for prompt, out in zip(prompts, outs):
        expected = hf_prompt_logprobs(path, prompt)[torch.arange(59), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor([e.logprob for e in out.prompt_logprobs]), expected, atol=1e-4)


# ---------------------------------------------------------------- echo through the server


@pytest.fixture(scope="module")
def server(path):
    srv = Server(path, "--max-prefill-length", "8")  # prompts scored over several chunks
    yield srv
    assert srv.stop() == 0


PROMPT = "The scheduler decides which requests run next"


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list, list]:
    text, tokens, token_logprobs = "", [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                token_logprobs += c.logprobs.token_logprobs
    return text, tokens, token_logprobs


def test_echo_puts_the_prompt_before_the_output(client, path):
    base = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPT, **base).choices[0].text
    assert client.completions.create(prompt=PROMPT, echo=True, **base).choices[0].text == PROMPT + plain
    assert streamed(client, prompt=PROMPT, echo=True, **base)[0] == PROMPT + plain
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, add_special_tokens=False)["input_ids"]
    assert client.completions.create(prompt=ids, echo=True, **base).choices[0].text == PROMPT + plain


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_like_transformers(client, path, stream):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 1, logprobs 1."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    kwargs = dict(model="tiny", prompt=PROMPT, echo=True, max_tokens=1, logprobs=1, temperature=0)
    if stream:
        text, tokens, token_logprobs = streamed(client, **kwargs)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, tokens, token_logprobs = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        offsets, top = choice.logprobs.text_offset, choice.logprobs.top_logprobs
        assert offsets[:len(ids)] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
        assert top[0] is None  # each later position: the prompt's token and the best one (vLLM's shape)
        assert all(token in alts and len(alts) <= 2 for token, alts in zip(tokens[1:], top[1:], strict=True))
    assert text.startswith(PROMPT) and len(tokens) == len(ids) + 1
    assert tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids] and token_logprobs[0] is None
    expected = hf_prompt_logprobs(path, ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(token_logprobs[1:len(ids)]), expected, atol=1e-4)
