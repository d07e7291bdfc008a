"""The few-token MoE GEMVs (`minisgl.kernels.moe_gemv`) at qwen3-30b-a3b's shapes (128 experts, top 8, hidden
2048, I_local 768 at TP 1 and 384 at TP 2), compiled: bf16 and FP8 experts against `experts_torch`, replayed
in a CUDA graph as the decode step runs them, and one compile for every token count."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_compiles
from kernels.test_fp8_kernels import BLOCK128, TOL, check_experts
from kernels.test_moe_gemv import TOL as BF16_TOL

from minisgl.kernels.moe_gemv import moe_gemv
from minisgl.layers.fp8 import quantize_weight
from minisgl.layers.moe import experts_torch, route
from minisgl.quantization import Fp8Config

EXPERTS, TOP_K, HIDDEN = 128, 8, 2048


def make_case(tokens: int, inter: int, fp8: Fp8Config | None, seed: int = 0):
    """x, w13, w2, weights, int32 ids and the experts' (w13, w2) scales (None for bf16)."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=cuda).manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen, device=cuda) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, inter, generator=gen, device=cuda) / inter**0.5
    scales = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_weight(w13, fp8), quantize_weight(w2, fp8)
        scales = (s13, s2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    x = torch.randn(tokens, HIDDEN, generator=gen, device=cuda).bfloat16()
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen, device=cuda), TOP_K, True)
    return x, w13, w2, weights, ids.to(torch.int32), scales


@pytest.mark.parametrize("inter", [768, 384], ids=["tp1", "tp2"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_moe_gemv_bf16_full_size(tokens, inter):
    x, w13, w2, weights, ids, _ = make_case(tokens, inter, None, seed=tokens)
    torch.testing.assert_close(moe_gemv(x, w13, w2, weights, ids), experts_torch(x, w13, w2, weights, ids),
                               **BF16_TOL[torch.bfloat16])


@pytest.mark.parametrize("config", [BLOCK128, Fp8Config()], ids=["block128", "per_channel"])
@pytest.mark.parametrize("inter", [768, 384], ids=["tp1", "tp2"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_moe_gemv_fp8_full_size(tokens, inter, config):
    check_experts(tokens, EXPERTS, TOP_K, HIDDEN, inter, config, None, kernel=moe_gemv)


@pytest.mark.parametrize("fp8", [None, BLOCK128], ids=["bf16", "fp8_block128"])
def test_moe_gemv_replays_in_a_cuda_graph(fp8):
    """Captured once at 4 tokens, replayed on fresh activations and routing, against the reference each time."""
    x, w13, w2, weights, ids, scales = make_case(4, 768, fp8)
    moe_gemv(x, w13, w2, weights, ids, scales=scales, fp8=fp8)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(x, w13, w2, weights, ids, scales=scales, fp8=fp8)
    gen = torch.Generator(device=x.device).manual_seed(1)
    for _ in range(2):
        new_weights, new_ids = route(torch.randn(4, EXPERTS, generator=gen, device=x.device), TOP_K, True)
        x.normal_(generator=gen), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        expected = experts_torch(x, w13, w2, weights, ids, scales=scales, fp8=fp8)
        torch.testing.assert_close(out.float(), expected.float(), **(TOL if fp8 else BF16_TOL[torch.bfloat16]))


def test_moe_gemv_compiles_once_for_every_token_count():
    """No argument changes with the token count (it is the grid's): after T = 1, the others compile nothing."""
    cases = [make_case(tokens, 768, BLOCK128, seed=tokens) for tokens in (1, 2, 3, 4, 5, 8)]
    x, w13, w2, weights, ids, scales = cases[0]
    moe_gemv(x, w13, w2, weights, ids, scales=scales, fp8=BLOCK128)
    with triton_compiles() as compiled:
        for x, w13, w2, weights, ids, scales in cases[1:]:
            moe_gemv(x, w13, w2, weights, ids, scales=scales, fp8=BLOCK128)
        torch.cuda.synchronize()
    assert compiled == []
