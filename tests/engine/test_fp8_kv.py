"""An fp8 KV cache (`kv_cache_dtype="fp8"`) end to end, against transformers whose attention reads K/V
rounded to float8_e4m3fn as the pool stores them (scale 1.0).

That oracle, not the full-precision engine, is what the fp8 engine must equal: on these tiny random models
K/V reach +-11 and attention scores are large, so the 2% rounding of e4m3 moves logprobs by 0.6 to 7 and
flips greedy picks whose two best tokens lie ~3 apart; a comparison with the fp32 engine "up to the first
near-tie" would need a tolerance so loose that it proved nothing. Against the oracle the engine agrees to
FP8_TOLERANCE (see there). On the GPU (MINISGL_TEST_DEVICE=cuda) the same tests run the fast path: Triton
kernels over the fp8 pool, CUDA graphs, overlap, in fp32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, make_llm, random_prompts
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from minisgl import LLM, SamplingParams
from minisgl.engine.config import EngineArgs
from minisgl.server.args import parse_args

FP8 = torch.float8_e4m3fn
VOCAB = 400
PROMPTS = random_prompts([1, 7, 19, 64, 130, 257, 310, 33], VOCAB)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
# fp32 noise between two implementations tips a few K/V values across an e4m3 rounding boundary (a whole
# step, ~6%), each moving later logprobs a little: on the CPU the engine and transformers compute K/V alike and
# agree to 4e-5, but noise of 1e-6 (1e-5) on K/V before rounding moves them by up to 0.025 (0.084). A greedy
# pick closer to a tie than this may go either way. Full precision strays from the oracle by 0.6 to 7.
FP8_TOLERANCE = 0.1


def _fp8_kv_sdpa(module, query, key, value, *args, **kwargs):
    """transformers' SDPA over K/V as an fp8 pool holds them (post-RoPE, post k-norm, as the engine stores)."""
    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(FP8).to(x.dtype)
    return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)


AttentionInterface.register("fp8_kv_sdpa", _fp8_kv_sdpa)
_ORACLES: dict[str, torch.nn.Module] = {}


def fp8_oracle_logprobs(path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log-probabilities of the fp8-KV transformers model, teacher-forced on `output`."""
    if path not in _ORACLES:
        _ORACLES[path] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fp8_kv_sdpa").to(DEVICE)
    with torch.no_grad():
        logits = _ORACLES[path].eval()(torch.tensor([prompt + output], device=DEVICE)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], -1).cpu()


def assert_matches_fp8_oracle(path: str, prompts: list[list[int]], outs) -> None:
    """Every step (teacher-forced on the engine's own tokens): the oracle's greedy pick unless it nearly ties,
    and the chosen token's logprob within FP8_TOLERANCE."""
    for prompt, out in zip(prompts, outs):
        truth = fp8_oracle_logprobs(path, prompt, out.token_ids)
        for step, token in enumerate(out.token_ids):
            top = truth[step].topk(2)
            if top.values[0] - top.values[1] >= FP8_TOLERANCE:
                assert token == top.indices[0].item(), f"prompt of {len(prompt)}, step {step}"
            assert abs(out.logprobs[step].logprob - truth[step, token].item()) < FP8_TOLERANCE, f"step {step}"


def oracle_distance(path: str, prompts: list[list[int]], outs) -> float:
    """The largest distance of an engine's chosen-token logprobs from the fp8 oracle's, on its own tokens."""
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        truth = fp8_oracle_logprobs(path, prompt, out.token_ids)[torch.arange(len(out.token_ids)), out.token_ids]
        worst = max(worst, (torch.tensor([lp.logprob for lp in out.logprobs]) - truth).abs().max().item())
    return worst


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


VARIANTS = {"page1": dict(page_size=1), "chunk16_page16": dict(page_size=16, max_prefill_tokens=16)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fp8_engine_equals_transformers_over_fp8_kv(tiny_models, arch, variant):
    llm = make_llm(tiny_models[arch], kv_cache_dtype="fp8", **VARIANTS[variant])
    assert llm.engine.pool.k.dtype == llm.engine.pool.v.dtype == FP8
    assert_matches_fp8_oracle(tiny_models[arch], PROMPTS, llm.generate(PROMPTS, GREEDY))
    assert_no_leak(llm)


def test_a_full_precision_pool_strays_from_the_fp8_oracle(tiny_models):
    """The oracle tells fp8 from full precision: the fp32 pool's logprobs lie far beyond the tolerance from it."""
    path = tiny_models["llama"]
    assert oracle_distance(path, PROMPTS, make_llm(path).generate(PROMPTS, GREEDY)) > 10 * FP8_TOLERANCE


def test_fp8_radix_cache_serves_shared_prefixes(tiny_models):
    """Cached fp8 pages are read back by later requests as they were stored."""
    path = tiny_models["qwen3"]
    shared = random_prompts([100], VOCAB, seed=1)[0]
    first = [shared + tail for tail in random_prompts([5, 30], VOCAB, seed=2)]
    second = [shared + tail for tail in random_prompts([3, 12, 40], VOCAB, seed=3)]
    llm = make_llm(path, kv_cache_dtype="fp8", page_size=16)
    outs1, outs2 = llm.generate(first, GREEDY), llm.generate(second, GREEDY)
    assert all(out.cached_tokens >= 96 for out in outs2)
    assert_matches_fp8_oracle(path, first + second, outs1 + outs2)
    assert_no_leak(llm)


@pytest.mark.parametrize("overlap", [True, False])
def test_fp8_retraction_keeps_output(tiny_models, overlap):
    """Requests retracted for lack of pages are recomputed into fp8 pages with the same result."""
    prompts = random_prompts([12, 40, 25, 33, 18, 9, 28, 37], VOCAB, seed=4)
    llm = make_llm(tiny_models["llama"], kv_cache_dtype="fp8", num_pages=120, overlap_schedule=overlap)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["num_retracted"] > 0
    assert_matches_fp8_oracle(tiny_models["llama"], prompts, outs)
    assert_no_leak(llm)


def test_fp8_tensor_parallel_tp2_equals_oracle(tiny_models):
    """Each rank's pool holds its KV heads in fp8."""
    path = tiny_models["qwen3_moe"]
    with make_llm(path, kv_cache_dtype="fp8", tp_size=2, max_prefill_tokens=64) as llm:
        assert llm.engine.pool.k.dtype == FP8 and llm.engine.pool.k.shape[2] == 1  # 2 KV heads over 2 ranks
        assert_matches_fp8_oracle(path, PROMPTS, llm.generate(PROMPTS, GREEDY))


def test_fp8_triton_backend(tiny_models):
    """The Triton store and attention kernels over an fp8 pool, end to end (chunked prefill, then decode); on
    the CPU in Triton's interpreter."""
    path = tiny_models["qwen3"]
    prompts = random_prompts([1, 7, 19, 40], VOCAB, seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    llm = make_llm(path, kv_cache_dtype="fp8", attention_backend="triton", page_size=16, max_prefill_tokens=24)
    assert_matches_fp8_oracle(path, prompts, llm.generate(prompts, params))


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_pool_holds_twice_the_pages_of_bf16(tiny_models, name):
    """Sized from the same memory (the CPU's fixed budget), an fp8 pool has twice bf16's pages in as many bytes."""
    path = tiny_models["qwen3"]
    kw = dict(dtype="bfloat16", num_pages=None, device="cpu", cuda_graph_max_bs=0)
    full, fp8 = make_llm(path, **kw).engine, make_llm(path, kv_cache_dtype=name, **kw).engine
    assert full.pool.k.dtype == torch.bfloat16 and fp8.pool.k.dtype == FP8
    assert fp8.num_pages in (2 * full.num_pages, 2 * full.num_pages + 1)
    assert fp8.pool.k.nbytes == pytest.approx(full.pool.k.nbytes, rel=0.01)


def test_kv_cache_dtype_flag():
    args = parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e4m3"])
    assert args.engine.kv_cache_dtype == "fp8_e4m3"
    assert parse_args(["--model", "m"]).engine.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        EngineArgs("m", kv_cache_dtype="int8")
