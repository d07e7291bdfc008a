"""The GPU fast path (Triton kernels, CUDA graphs, overlap) against the references, in bf16.

Collected only with MINISGL_TEST_DEVICE=cuda (see conftest.py). bf16 rounding can flip a greedy
choice where the two best tokens nearly tie, so tokens are compared up to the first such near-tie of
the reference, and log-probabilities with a bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, hf_logprobs, make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.messages import AddReq

VOCAB = 400
PROMPTS = random_prompts([1, 7, 33, 130, 260], VOCAB, seed=11)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# bf16 noise of two implementations on these tiny random models, both rounding apart from the fp32 truth
# (transformers in bf16 is held to the same 0.15 below): a logprob may move by that much, and a greedy pick
# whose two best tokens lie closer than that in the reference may go either way.
BF16_TOLERANCE = 0.15


def reference_engine(path: str) -> LLM:
    return make_llm(path, dtype="bfloat16", attention_backend="torch", cuda_graph_max_bs=0, overlap_schedule=False)


def assert_same_greedy(fast, ref) -> None:
    """Equal tokens up to the reference's first near-tie (where either pick is right, and the texts may part);
    chosen-token logprobs within bf16 noise."""
    for got, want in zip(fast, ref):
        for step, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
            if w.top[0][1] - w.top[1][1] < BF16_TOLERANCE:
                break
            assert g.token_id == w.token_id, f"step {step}"
            assert abs(g.logprob - w.logprob) < BF16_TOLERANCE, f"step {step}"


def bf16_error(path: str, outs) -> float:
    """The largest distance of an engine's chosen-token logprobs from transformers' in float32 (the truth),
    scored on that engine's own tokens."""
    worst = 0.0
    for out, prompt in zip(outs, PROMPTS):
        truth = hf_logprobs(path, prompt, out.token_ids)[torch.arange(len(out.token_ids)), out.token_ids]
        worst = max(worst, (torch.tensor([lp.logprob for lp in out.logprobs]) - truth.cpu()).abs().max().item())
    return worst


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_path_matches_torch_reference_and_transformers(tiny_models, arch):
    """In bf16 the fast path picks the reference's tokens, and strays from the float32 truth no further than
    the torch reference does (in float32 it is token-exact against transformers: test_engine_vs_hf)."""
    path = tiny_models[arch]
    fast = make_llm(path, dtype="bfloat16")
    assert fast.engine.graphs is not None and fast.scheduler.overlap
    got, want = fast.generate(PROMPTS, PARAMS), reference_engine(path).generate(PROMPTS, PARAMS)
    assert_same_greedy(got, want)
    assert bf16_error(path, got) <= 1.5 * bf16_error(path, want) + 0.02


@pytest.mark.parametrize("batch", [3, 20])
def test_graph_replay_matches_eager_decode(tiny_models, batch):
    """Batches padded up to a bucket (3 -> 4, 20 -> 32) decode as the eager path does."""
    path = tiny_models["qwen3"]
    prompts = random_prompts([5 + 3 * i for i in range(batch)], VOCAB, seed=12)
    graphs = make_llm(path, dtype="bfloat16", cuda_graph_max_bs=32)
    eager = make_llm(path, dtype="bfloat16", cuda_graph_max_bs=0)
    assert_same_greedy(graphs.generate(prompts, PARAMS), eager.generate(prompts, PARAMS))


def test_launching_a_decode_step_never_waits_for_the_device(tiny_models):
    llm = make_llm(tiny_models["qwen3"], dtype="bfloat16")
    sched = llm.scheduler
    params = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True, seed=3)
    sched.sync_and_apply([AddReq(Req(i, p, params, seed=i)) for i, p in enumerate(random_prompts([9, 17], VOCAB))])
    for _ in range(4):  # past prefill: every running request decodes now
        sched.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = sched.engine.sample(sched.engine.forward(sched._next_batch()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert launched is not None and launched.batch.is_decode and len(launched.batch.reqs) == 2
