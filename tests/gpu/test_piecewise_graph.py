"""Steps with prefill tokens replayed from piecewise CUDA graphs (minisgl/engine/piecewise_graph.py) give the
eager forward's outputs: the same greedy tokens, and logprobs of sampled and prompt tokens (the latter read the
graphs' full hidden state) equal up to float32 rounding, for a dense and an MoE model, prompts padded up to their
bucket, and prompts chunked into steps that mix them with running decodes (consecutive steps of one bucket and
different sizes: a padding row storing its K/V anywhere but the scratch slot would corrupt a request's cache).
Collected only with MINISGL_TEST_DEVICE=cuda (see conftest.py)."""

from __future__ import annotations

import pytest
from helpers import make_llm, random_prompts

from minisgl import LLM, SamplingParams

VOCAB = 400
PROMPTS = random_prompts([1, 7, 33, 130, 260, 517], VOCAB, seed=5)  # none a bucket's size: every step is padded
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
TOLERANCE = 2e-3  # float32 GEMMs of padded and unpadded shapes may pick different kernels
BF16_TOLERANCE = 0.15  # bf16 noise between two kernel choices on these tiny random models


def without_piecewise(llm: LLM) -> LLM:
    llm.engine.piecewise.release()
    llm.engine.piecewise = None
    return llm


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_id == w.token_id
        assert abs(g.logprob - w.logprob) < TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("budget", [8192, 96])  # 96: chunks that share their steps with the running decodes
def test_piecewise_graphs_give_the_eager_forward_outputs(tiny_models, arch, budget):
    graphs = make_llm(tiny_models[arch], max_prefill_tokens=budget)
    eager = without_piecewise(make_llm(tiny_models[arch], max_prefill_tokens=budget))
    piecewise, replays = graphs.engine.piecewise, []
    run = piecewise.run
    piecewise.run = lambda ids, *rest: replays.append(ids.shape[0]) or run(ids, *rest)
    got, want = graphs.generate(PROMPTS, PARAMS), eager.generate(PROMPTS, PARAMS)
    assert replays  # the graphs served the steps with prefill tokens
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert_close(g.logprobs, w.logprobs)
        assert_close(g.prompt_logprobs, w.prompt_logprobs)


def test_a_step_above_the_largest_bucket_runs_eagerly(tiny_models):
    llm = make_llm(tiny_models["qwen3"])
    assert llm.engine.piecewise.max_tokens >= 1024  # a tiny model's eager steps are host-bound
    llm.engine.piecewise.release()
    llm.engine.piecewise = llm.engine._capture_piecewise(256)
    want = without_piecewise(make_llm(tiny_models["qwen3"])).generate(PROMPTS, PARAMS)
    for g, w in zip(llm.generate(PROMPTS, PARAMS), want):  # one 948-token step: eager; then decodes
        assert g.token_ids == w.token_ids
        assert_close(g.prompt_logprobs, w.prompt_logprobs)


def test_fp8_weights_in_bf16_pick_the_eager_forwards_tokens(tiny_models):
    """FP8 weights (`--quantization fp8`) in bf16: padded and unpadded GEMMs round apart, so tokens are equal up
    to the eager run's first near-tie and logprobs within bf16 noise (as tests/gpu/test_fast_path.py holds)."""
    kwargs = {"dtype": "bfloat16", "quantization": "fp8", "max_prefill_tokens": 96}
    graphs = make_llm(tiny_models["qwen3"], **kwargs)
    eager = without_piecewise(make_llm(tiny_models["qwen3"], **kwargs))
    for got, want in zip(graphs.generate(PROMPTS, PARAMS), eager.generate(PROMPTS, PARAMS)):
        for g, w in zip(got.logprobs, want.logprobs):
            if w.top[0][1] - w.top[1][1] < BF16_TOLERANCE:
                break
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < BF16_TOLERANCE


def test_the_step_cost_model_is_measured_from_the_buckets_replays(tiny_models):
    """The scheduler's step cost model (engine/step_cost.py): one figure per bucket, larger steps never cheaper,
    and decode attention's cost per cached token from the device's bandwidth (well above 1 TB/s here)."""
    llm = make_llm(tiny_models["qwen3"])  # kept: an LLM that goes releases its engine's graphs
    engine = llm.engine
    cost, buckets = engine.step_cost, engine.piecewise.buckets
    assert cost.tokens == tuple(buckets) and len(cost.linear_ms) == len(buckets)
    assert 0 < cost.linear_ms[0] and list(cost.linear_ms) == sorted(cost.linear_ms)
    bytes_per_token = engine.pool.bytes_per_token(engine.config.num_layers, engine.model.model.layers[0].self_attn
                                                  .kv_heads, engine.config.head_dim, engine.kv_dtype)
    assert 0 < cost.kv_ms_per_token < bytes_per_token / 1e9  # ms per token at more than 1e9 bytes per ms
