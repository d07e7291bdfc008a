"""The FP8 kernels at qwen3-8b's and qwen3-30b-a3b's shapes, compiled, in bfloat16 with 128 x 128 blocks,
against their torch reference (the interpreter's small shapes are tests/kernels/test_fp8_kernels.py)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from helpers import triton_compiles
from kernels.test_fp8_kernels import (
    BLOCK128,
    GPU_SHAPES,
    TOL,
    check_experts,
    check_linear,
    check_silu_mul_linear,
    check_silu_mul_quantization,
    gemv_fp8,
)

from minisgl.kernels import use_pdl
from minisgl.kernels.fp8 import Fp8GemmConfig, fp8_gemm
from minisgl.kernels.fused_moe import MoEConfig, fused_experts
from minisgl.kernels.gemv import BLOCK_M, gemv
from minisgl.kernels.norm import add_rms_norm
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.fp8 import fp8_linear_torch, quantize_weight
from minisgl.layers.linear import fp8_linear
from minisgl.layers.moe import experts_torch, route
from minisgl.layers.norm import RMSNorm
from minisgl.quantization import Fp8Config


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 16, 64, 512])
def test_fp8_linear_full_size(shape, m):
    """The GEMV up to its 16 rows; the GEMM from 16 rows, with the tuned tiles (64 or 128 columns: one weight
    scale per group) and 256-column ones (a weight scale per column)."""
    kernels = [gemv_fp8(None)] if m <= BLOCK_M else []
    if m >= 16:
        wide = Fp8GemmConfig(block_m=64, block_n=256, num_warps=8)
        kernels += [fp8_gemm, lambda x, w, s, c, b: fp8_gemm(x, w, s, c, b, wide)]
    for kernel in kernels:
        check_linear(kernel, m, *shape, BLOCK128)
        check_linear(kernel, m, *shape, Fp8Config())


@pytest.mark.parametrize("m", [512, 4096])
def test_fp8_down_with_silu_mul_full_size(m):
    """qwen3-8b's down projection (I = 12,288) from [gate | up] at prefill sizes: the quantization forms
    silu(gate) * up bit for bit as silu_and_mul then quantize_activation did (padded rows, and rows of a wider
    tensor), and the Triton GEMM and the layers' dispatch (cuBLAS on Hopper from 32 rows) give bit for bit what
    they give for silu_and_mul's output, close to the reference."""
    n, k = GPU_SHAPES[3]
    check_silu_mul_quantization(m, k, m + 16, 128, torch.bfloat16, row_pad=0)
    check_silu_mul_quantization(m, k, m, 128, torch.bfloat16, row_pad=256)
    for config in (BLOCK128, Fp8Config()):
        check_silu_mul_linear(lambda x, w, s, c: fp8_gemm(x, w, s, c, silu_mul=True), m, n, k, config,
                              two_pass=fp8_gemm)
        check_silu_mul_linear(lambda x, w, s, c: fp8_linear(x, w, s, c, silu_mul=True), m, n, k, config,
                              two_pass=fp8_linear)


@pytest.mark.parametrize("tokens", [1, 8, 256, 1024])
def test_fp8_fused_experts_full_size(tokens):
    """qwen3-30b-a3b's experts at TP 1: 128 experts, top 8, hidden 2048, intermediate 768, with FP8_CONFIGS'
    tiles (x quantized in the tiles or by its own launch, whichever the row says). 1,024 tokens give 2M
    outputs: a few neighbouring-e4m3 flips are allowed (see TOL)."""
    check_experts(tokens, 128, 8, 2048, 768, BLOCK128, None, flips=4 if tokens >= 1024 else 0)


@pytest.mark.parametrize("in_tile", [False, True], ids=["x_quantized_once", "x_quantized_in_tiles"])
@pytest.mark.parametrize("tokens, tiles", [
    (4, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (64, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
    (1024, MoEConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4)),
    (1024, MoEConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)),
], ids=["decode_mma", "decode_narrow", "prefill_wgmma64", "prefill_wgmma128"])
def test_fp8_fused_experts_both_quantizations(tokens, tiles, in_tile):
    """Both ways of quantizing the activations, each on mma.sync (16-row) and wgmma (64- and 128-row) tiles
    of the kind the FP8 sweep (`benchmarks/moe.py --fp8 --sweep`) may write to the table."""
    check_experts(tokens, 128, 8, 2048, 768, BLOCK128, replace(tiles, in_tile=in_tile),
                  flips=4 if tokens >= 1024 else 0)


def test_fp8_fused_experts_replay_in_a_cuda_graph():
    """FP8 experts as the decode step runs them: captured once (the quantize launches and their buffers
    included), replayed on fresh activations and routing, against the reference each time."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=cuda).manual_seed(0)
    w13, s13 = quantize_weight(torch.randn(128, 1536, 2048, generator=gen, device=cuda) / 2048**0.5, BLOCK128)
    w2, s2 = quantize_weight(torch.randn(128, 2048, 768, generator=gen, device=cuda) / 768**0.5, BLOCK128)
    x = torch.randn(96, 2048, generator=gen, device=cuda).bfloat16()
    weights, ids = route(torch.randn(96, 128, generator=gen, device=cuda), 8, True)
    ids = ids.to(torch.int32)
    run = functools.partial(fused_experts, scales=(s13, s2), fp8=BLOCK128)
    run(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, w13, w2, weights, ids)
    for _ in range(2):
        new_weights, new_ids = route(torch.randn(96, 128, generator=gen, device=cuda), 8, True)
        x.normal_(generator=gen), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        expected = experts_torch(x, w13, w2, weights, ids, scales=(s13, s2), fp8=BLOCK128)
        torch.testing.assert_close(out.float(), expected.float(), **TOL)


@pytest.mark.parametrize("experts, top_k, hidden, inter, tokens, config", [
    (8, 2, 64, 32, 8192, Fp8Config()), (128, 8, 2048, 768, 1024, Fp8Config()), (128, 8, 2048, 768, 1024, BLOCK128),
], ids=["tiny_moe_prefill", "qwen3_30b_a3b_1024_per_channel", "qwen3_30b_a3b_1024_block128"])
def test_fp8_fused_experts_float32_activations(experts, top_k, hidden, inter, tokens, config):
    """float32 x doubles the activation tile of the tiles tuned for bf16: the tiny qwen3_moe of
    tests/engine/test_fp8_weights.py at a prefill-sized batch took 128 x 128 x 128 tiles in 3 stages (245,760
    bytes of shared memory; the H200 has 232,448) and qwen3-30b-a3b's 1,024-token row 237,568; both failed
    to launch before the tiles were fitted to the device (`fused_moe.launch_config`). Unrounded float32 outputs
    show a neighbouring-e4m3 flip in full (on an H200, 1 of 524,288 outputs 0.075 off): a few are allowed."""
    check_experts(tokens, experts, top_k, hidden, inter, config, None, torch.float32, flips=4)


def test_decode_chain_in_a_cuda_graph_with_programmatic_dependent_launch():
    """add+RMSNorm -> gate_up GEMV -> down GEMV (SiLU-and-mul inside), qwen3-8b's MLP in FP8, captured once
    and replayed on fresh inputs: with programmatic dependent launch (on Hopper) each GEMV starts before the
    kernel it depends on has finished, so one that read x before its wait would give the previous replay's
    (or a half-written) result."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    assert use_pdl(cuda) == (torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device=cuda).manual_seed(0)
    w13, s13 = quantize_weight(torch.randn(24576, 4096, generator=gen, device=cuda) / 64, BLOCK128)
    w2, s2 = quantize_weight(torch.randn(4096, 12288, generator=gen, device=cuda) / 110, BLOCK128)
    norm = RMSNorm(4096, 1e-6).to(cuda, torch.bfloat16)
    x, residual = (torch.empty(1, 4096, device=cuda, dtype=torch.bfloat16) for _ in range(2))

    def mlp() -> torch.Tensor:
        h, _ = add_rms_norm(x, residual, norm.weight, norm.eps)
        return gemv(gemv(h, w13, scale=s13, fp8=BLOCK128), w2, scale=s2, fp8=BLOCK128, silu_mul=True)

    x.normal_(generator=gen), residual.normal_(generator=gen)
    mlp()  # compiles, and creates the split-K counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp()
    for _ in range(3):
        x.normal_(generator=gen), residual.normal_(generator=gen)
        graph.replay()
        h, _ = norm.forward_torch(x, residual)
        expected = fp8_linear_torch(silu_and_mul_torch(fp8_linear_torch(h, w13, s13, BLOCK128)), w2, s2, BLOCK128)
        torch.testing.assert_close(out.float(), expected.float(), **TOL)


def test_fp8_fused_experts_compile_once_for_every_token_count():
    """qwen3-30b-a3b's FP8 experts at token counts of one table row (> 1,024: the 128-row tiles), even and odd:
    the first compiles the activation quantization and the two expert GEMMs, the others nothing. The integer
    arguments that follow the token count (the quantized rows, the activation scales' stride) must not be
    specialized: an odd count of a large W1 step compiled both again, ~3 s of qwen3-30b-a3b FP8's first W1 on an
    H100."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=cuda).manual_seed(0)
    w13, s13 = quantize_weight(torch.randn(128, 1536, 2048, generator=gen, device=cuda) / 2048**0.5, BLOCK128)
    w2, s2 = quantize_weight(torch.randn(128, 2048, 768, generator=gen, device=cuda) / 768**0.5, BLOCK128)

    def experts(tokens: int) -> None:
        x = torch.randn(tokens, 2048, generator=gen, device=cuda).bfloat16()
        weights, ids = route(torch.randn(tokens, 128, generator=gen, device=cuda), 8, True)
        fused_experts(x, w13, w2, weights, ids.to(torch.int32), scales=(s13, s2), fp8=BLOCK128)

    experts(1536)
    with triton_compiles() as compiled:
        for tokens in (1537, 2051, 4096, 3001):
            experts(tokens)
        torch.cuda.synchronize()
    assert compiled == []
