"""Steps with prefill tokens replayed from whole-step CUDA graphs (minisgl/engine/whole_graph.py) give the eager
forward's outputs: the same greedy tokens, and logprobs of sampled and prompt tokens (the latter read the graphs'
full hidden state) equal up to float32 rounding, for a dense and an MoE model, prompts padded up to their bucket,
prompts chunked into steps that mix them with running decodes (consecutive steps of one bucket and different
sizes: stale metadata or a padding row storing its K/V anywhere but the scratch slot would corrupt a request's
cache), prompts after a cached prefix, and a step with more chunks than the graphs hold (eager). One replay, no
eager attention, serves such a step. Collected only with MINISGL_TEST_DEVICE=cuda (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req
from minisgl.engine import whole_graph

VOCAB = 400
PROMPTS = random_prompts([1, 7, 33, 130, 260, 517], VOCAB, seed=5)  # none a bucket's size: every step is padded
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
TOLERANCE = 2e-3  # float32 GEMMs of padded and unpadded shapes may pick different kernels
BF16_TOLERANCE = 0.15  # bf16 noise between two kernel choices on these tiny random models


def without_whole(llm: LLM) -> LLM:
    llm.engine.whole.release()
    llm.engine.whole = None
    return llm


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_id == w.token_id
        assert abs(g.logprob - w.logprob) < TOLERANCE


def assert_same_outputs(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert_close(g.logprobs, w.logprobs)
        if w.prompt_logprobs is not None:
            assert_close(g.prompt_logprobs, w.prompt_logprobs)


def count_runs(llm: LLM) -> list[int]:
    """The token counts of the steps the whole-step graphs serve from now on."""
    whole, runs = llm.engine.whole, []
    run = whole.run
    whole.run = lambda inputs, *rest: runs.append(inputs.input_ids.shape[0]) or run(inputs, *rest)
    return runs


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("budget", [8192, 96])  # 96: chunks that share their steps with the running decodes
def test_whole_graphs_give_the_eager_forward_outputs(tiny_models, arch, budget):
    graphs = make_llm(tiny_models[arch], max_prefill_tokens=budget)
    eager = without_whole(make_llm(tiny_models[arch], max_prefill_tokens=budget))
    runs = count_runs(graphs)
    got, want = graphs.generate(PROMPTS, PARAMS), eager.generate(PROMPTS, PARAMS)
    assert runs  # the graphs served the steps with prefill tokens
    assert_same_outputs(got, want)


def test_a_served_sequence_with_cached_prefixes_and_too_many_chunks(tiny_models, monkeypatch):
    """Three waves as a server meets them, each against an eager engine fed the same: ragged prompts chunked beside
    decodes; prompts that extend a cached prefix of the first wave's (the extend kernel reads the prefix through
    the page table); and a burst of more prompts than the graphs' chunk cap (4 here), whose first step runs
    eagerly while the steps after it (fewer chunks beside the decodes) replay graphs."""
    monkeypatch.setattr(whole_graph, "MAX_CHUNKS", 4)
    kwargs = {"max_prefill_tokens": 160}
    graphs, eager = make_llm(tiny_models["qwen3"], **kwargs), without_whole(make_llm(tiny_models["qwen3"], **kwargs))
    assert graphs.engine.whole.static.values.shape[1] >= 4
    first = random_prompts([70, 9, 300, 41], VOCAB, seed=6)
    extended = [p + q for p, q in zip(first, random_prompts([5, 60, 17, 1], VOCAB, seed=7))]
    burst = random_prompts([3, 12, 25, 8, 40, 19, 2], VOCAB, seed=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs, eager_steps = count_runs(graphs), []
    hidden = graphs.engine._hidden
    graphs.engine._hidden = lambda inputs, backend: eager_steps.append(inputs.input_ids.shape[0]) or hidden(
        inputs, backend)
    for wave in (first, extended):
        assert_same_outputs(graphs.generate(wave, params), eager.generate(wave, params))
    assert runs and not eager_steps
    assert_same_outputs(graphs.generate(burst, params), eager.generate(burst, params))
    assert eager_steps  # the burst's step of 7 chunks
    engine = graphs.engine
    too_many = Batch([Req(i, [3] * 4, SamplingParams(max_tokens=1), seed=0, row=i) for i in range(6)],
                     [0] * 6, [4] * 6, sampled=list(range(6)))
    assert engine.step_kind(too_many) == ("eager", None)  # 6 chunks > 4: the eager path, as the burst's first step


def test_one_replay_serves_a_mixed_step(tiny_models):
    """A mixed step (decodes, then prompt chunks) enqueues one graph replay and no eager attention call or eager
    forward: its enqueue is copies and the replay (then the eager last-row logits)."""
    llm = make_llm(tiny_models["qwen3"])
    engine = llm.engine
    lens = [1] * 5 + [37, 90]
    kv = [20, 3, 64, 0, 11, 0, 16]
    batch = Batch([Req(i, [3] * (k + n), SamplingParams(max_tokens=1), seed=0, row=i)
                   for i, (k, n) in enumerate(zip(kv, lens))], kv, lens, sampled=list(range(len(lens))))
    bucket = engine.step_kind(batch)
    assert bucket[0] == "whole"
    replays, attends, forwards = [], [], []

    class Counted:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            replays.append(1)
            self.graph.replay()

    engine.whole.graphs = {t: Counted(g) for t, g in engine.whole.graphs.items()}
    attend, model_forward = engine.prefill_backend.attend, engine.model.forward
    engine.prefill_backend.attend = lambda *a, **k: attends.append(1) or attend(*a, **k)
    engine.model.forward = lambda *a, **k: forwards.append(1) or model_forward(*a, **k)
    step = engine.forward(batch)
    torch.cuda.synchronize()
    assert (len(replays), len(attends), len(forwards)) == (1, 0, 0)
    assert step.logits.shape[0] == len(lens) and torch.isfinite(step.logits).all()


def test_a_step_above_the_largest_bucket_runs_eagerly(tiny_models):
    llm = make_llm(tiny_models["qwen3"])
    assert llm.engine.whole.max_tokens >= 1024  # a tiny model's eager steps are host-bound
    llm.engine.whole.release()
    llm.engine.whole = llm.engine._capture_whole(256)
    want = without_whole(make_llm(tiny_models["qwen3"])).generate(PROMPTS, PARAMS)
    for g, w in zip(llm.generate(PROMPTS, PARAMS), want):  # one 948-token step: eager; then decodes
        assert g.token_ids == w.token_ids
        assert_close(g.prompt_logprobs, w.prompt_logprobs)


@pytest.mark.parametrize("fp8", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}], ids=["weights", "kv_pool"])
def test_fp8_in_bf16_picks_the_eager_forwards_tokens(tiny_models, fp8):
    """FP8 weights (`--quantization fp8`), or an fp8 KV pool (the graphs' attention loads fp8 as the eager kernels
    do), under a bf16 model: padded and unpadded GEMMs round apart, so tokens are equal up to the eager run's first
    near-tie and logprobs within bf16 noise (as tests/gpu/test_fast_path.py holds)."""
    kwargs = {"dtype": "bfloat16", "max_prefill_tokens": 96, **fp8}
    graphs = make_llm(tiny_models["qwen3"], **kwargs)
    eager = without_whole(make_llm(tiny_models["qwen3"], **kwargs))
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
    cost, buckets = engine.step_cost, engine.whole.buckets
    assert cost.tokens == tuple(buckets) and len(cost.linear_ms) == len(buckets)
    assert 0 < cost.linear_ms[0] and list(cost.linear_ms) == sorted(cost.linear_ms)
    bytes_per_token = engine.pool.bytes_per_token(engine.config.num_layers, engine.model.model.layers[0].self_attn
                                                  .kv_heads, engine.config.head_dim, engine.kv_dtype)
    assert 0 < cost.kv_ms_per_token < bytes_per_token / 1e9  # ms per token at more than 1e9 bytes per ms
