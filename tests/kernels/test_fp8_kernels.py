"""The FP8 kernels (GEMM, decode GEMV, fused experts) against their torch reference, `fp8_linear_torch`
and `experts_torch` with FP8 experts.

On the CPU they run in Triton's interpreter (tests/helpers.py sets TRITON_INTERPRET=1) at small shapes with
tails in N and K, float32 activations; tests/gpu/test_fp8_kernels_full_size.py runs them compiled, in
bfloat16, at qwen3-8b's and qwen3-30b-a3b's shapes with 128 x 128 blocks, with the helpers defined here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from minisgl.kernels.activation import silu_and_mul
from minisgl.kernels.fp8 import Fp8GemmConfig, fp8_gemm, quantize_activation
from minisgl.kernels.fused_moe import CONFIGS, FP8_CONFIGS, MoEConfig, fused_experts, pick_config
from minisgl.kernels.gemv import GemvConfig, gemv
from minisgl.layers import fp8 as reference
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.fp8 import fp8_linear_torch, quantize_weight
from minisgl.layers.moe import experts_torch, route
from minisgl.quantization import Fp8Config

DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
LOW_PRECISION = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter has no bfloat16
# The kernels and the reference round the same activations to the same e4m3 values and sum exact products
# in float32; what differs is the order of the sums (and on the GPU an approximate division that can move
# a value to the neighbouring e4m3 one: 4 of 524,288 experts outputs moved by 0.027) plus one rounding of
# the output to its dtype.
TOL = dict(rtol=2e-2, atol=5e-2) if ON_GPU else dict(rtol=1e-4, atol=1e-4)
SMALL = {"block16x32": Fp8Config(block=(16, 32)), "per_channel": Fp8Config()}
BLOCK128 = Fp8Config(block=(128, 128))
# (N, K) of qwen3-8b's decode projections (qkv, o, gate_up, down) at TP 1.
GPU_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def operands(m: int, n: int, k: int, config: Fp8Config, bias: bool = False, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(DTYPE)
    w, scale = quantize_weight(torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5, config)
    b = torch.randn(n, generator=gen, device=DEVICE).to(DTYPE) if bias else None
    return x, w, scale, b


def check_linear(kernel, m: int, n: int, k: int, config: Fp8Config, bias: bool = False) -> None:
    x, w, scale, b = operands(m, n, k, config, bias, seed=m + n + k)
    out = kernel(x, w, scale, config, b)
    assert out.shape == (m, n) and out.dtype == DTYPE
    torch.testing.assert_close(out.float().cpu(), fp8_linear_torch(x, w, scale, config, b).float().cpu(), **TOL)


def gemv_fp8(config: GemvConfig | None):
    return lambda x, w, scale, fp8, b: gemv(x, w, b, config, scale=scale, fp8=fp8)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("block_n", [16, 32], ids=["tile_in_block", "tile_over_blocks"])
@pytest.mark.parametrize("scales", list(SMALL))
@pytest.mark.parametrize("m", [1, 5, 40])
def test_fp8_gemm_small(scales, m, block_n):
    """N = 50 and K = 300: tails in both, a partial last scale group, two row tiles at M = 40. With 16-row
    blocks a 16-column tile takes one weight scale per group, a 32-column one a scale per column."""
    tiles = Fp8GemmConfig(block_m=32, block_n=block_n)
    check_linear(lambda x, w, s, c, b: fp8_gemm(x, w, s, c, b, tiles), m, 50, 300, SMALL[scales], bias=m == 5)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("split_k", [1, 4, None], ids=["whole", "split4", "default"])
@pytest.mark.parametrize("scales", list(SMALL))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fp8_gemv_small(scales, m, split_k):
    """Explicit 16-row tiles sit in one 16-row weight block (one weight scale a step); the default's
    128-row tiles span several (a scale per row)."""
    config = GemvConfig(block_n=16, block_k=32, split_k=split_k) if split_k else None
    check_linear(gemv_fp8(config), m, 50, 300, SMALL[scales], bias=m == 3)


def silu_mul_operands(m: int, n: int, k: int, config: Fp8Config, seed: int = 0):
    """The down projection's operands: [gate | up] [m, 2k] in DTYPE, e4m3 w [n, k] and its scales."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up = torch.randn(m, 2 * k, generator=gen, device=DEVICE).to(DTYPE)
    w, scale = quantize_weight(torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5, config)
    return gate_up, w, scale


def check_silu_mul_linear(kernel, m: int, n: int, k: int, config: Fp8Config, two_pass=None) -> None:
    """kernel(gate_up [m, 2k], w [n, k], scale, config) multiplies silu_and_mul(gate_up) W^T: against the
    reference of the two passes, and bit for bit `two_pass(silu_and_mul(gate_up), w, scale, config)` if given
    (the same GEMM fed the activation kernel's output, as it was before the fusion)."""
    gate_up, w, scale = silu_mul_operands(m, n, k, config, seed=m + n + k)
    out = kernel(gate_up, w, scale, config)
    assert out.shape == (m, n) and out.dtype == DTYPE
    expected = fp8_linear_torch(silu_and_mul_torch(gate_up), w, scale, config)
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), **TOL)
    if two_pass is not None:
        assert torch.equal(out, two_pass(silu_and_mul(gate_up), w, scale, config))


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_gemv_with_silu_mul(m):
    """The down projection's GEMV takes [gate | up] and forms silu(gate) * up itself, then quantizes it."""
    tiles = GemvConfig(block_n=16, block_k=32, split_k=4)
    check_silu_mul_linear(lambda x, w, s, c: gemv(x, w, None, tiles, scale=s, fp8=c, silu_mul=True), m, 50, 300,
                          SMALL["block16x32"])


def check_silu_mul_quantization(m: int, k: int, rows: int, group: int, dtype: torch.dtype, row_pad: int) -> None:
    """quantize_activation(x, silu_mul=True) for x [m, 2k] ([gate | up], rows `row_pad` columns apart when
    row_pad > 0) padded to `rows`: bit for bit the two-pass path's (silu_and_mul, then quantize_activation),
    and its real rows the torch reference's quantization of silu_and_mul_torch(x) within one e4m3 step, a few
    values apart (torch's silu may round the product one unit apart in x's dtype; on the GPU, division is
    approximate)."""
    gen = torch.Generator(device=DEVICE).manual_seed(m + k)
    x = (3 * torch.randn(m, 2 * k + row_pad, generator=gen, device=DEVICE)).to(dtype)[:, : 2 * k]
    q, s = quantize_activation(x, group, rows, silu_mul=True)
    two_pass_q, two_pass_s = quantize_activation(silu_and_mul(x), group, rows)
    assert q.shape == (rows, k) and s.shape == (-(-k // group), rows)
    assert torch.equal(q.float(), two_pass_q.float()) and torch.equal(s, two_pass_s)
    assert not q[m:].float().any()
    ref_q, ref_s = reference.quantize_activation(silu_and_mul_torch(x), group)
    ours = (q[:m].float() * s[:, :m].t().repeat_interleave(group, 1)[:, :k]).cpu()
    ref = (ref_q.float() * ref_s.repeat_interleave(group, 1)[:, :k]).cpu()
    # one e4m3 step (at most an eighth of the value; 2^-9 below 2^-6) and 1% of a scale apart
    assert ((ours - ref).abs() <= 0.13 * ref.abs() + 2**-9 * ref_s.max().cpu()).all()
    assert (q[:m].float().cpu() != ref_q.float().cpu()).sum() <= ours.numel() // 100
    torch.testing.assert_close(s[:, :m].t(), ref_s, rtol=1e-2, atol=0)  # one unit of bfloat16 in the largest value


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("dtype", [torch.float32, LOW_PRECISION], ids=str)
@pytest.mark.parametrize("m, rows, row_pad", [(5, 5, 0), (40, 48, 0), (17, 32, 50)],
                         ids=["unpadded", "padded", "padded_strided_rows"])
@pytest.mark.parametrize("group", [32, 128])
def test_quantization_with_silu_mul(m, rows, row_pad, group, dtype):
    """K = 300 is not a multiple of either group (a partial last group); in float16 the product is rounded to
    x's dtype before it is quantized, as silu_and_mul's output is."""
    check_silu_mul_quantization(m, 300, rows, group, dtype, row_pad)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("scales", list(SMALL))
def test_fp8_gemm_with_silu_mul(scales):
    """Above the GEMV's 16 rows the down projection's GEMM takes [gate | up] (40 rows: two row tiles), its
    activation formed while quantizing: the same output as silu_and_mul then the GEMM, bit for bit."""
    tiles = Fp8GemmConfig(block_m=32, block_n=16)
    check_silu_mul_linear(lambda x, w, s, c: fp8_gemm(x, w, s, c, tiles=tiles, silu_mul=True), 40, 50, 300,
                          SMALL[scales], two_pass=lambda x, w, s, c: fp8_gemm(x, w, s, c, tiles=tiles))


@pytest.mark.parametrize("scales", list(SMALL))
def test_quantize_weight_takes_each_expert_on_its_own(scales):
    """Stacked experts [E, N, K] (the benchmarks' and GPU tests' layout) quantize as each expert alone: the
    same e4m3 values and scales, [E, ...]."""
    config = SMALL[scales]
    magnitudes = torch.tensor([1.0, 10.0, 0.1])[:, None, None]
    w = torch.randn(3, 50, 70, generator=torch.Generator().manual_seed(0)) * magnitudes
    q, scale = quantize_weight(w, config)
    for expert in range(3):
        q1, scale1 = quantize_weight(w[expert], config)
        assert torch.equal(q[expert].float(), q1.float()) and torch.equal(scale[expert], scale1)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("in_tile", [False, True], ids=["x_quantized_once", "x_quantized_in_tiles"])
@pytest.mark.parametrize("block_n", [16, 32], ids=["tile_in_block", "tile_over_blocks"])
@pytest.mark.parametrize("scales", list(SMALL))
@pytest.mark.parametrize("tokens", [1, 9])
def test_fp8_fused_experts_small(scales, tokens, block_n, in_tile):
    """8 experts, top 2, hidden 64, intermediate 48 (not a multiple of the 32-column group). With 16-row
    blocks a 16-column tile takes one weight scale per group, a 32-column one (past N = 48: wrapped) one
    per column. The GEMMs take x (and the gate/up output) quantized by a launch of their own, or quantize
    them in their tiles."""
    check_experts(tokens, 8, 2, 64, 48, SMALL[scales], MoEConfig(block_m=16, block_n=block_n, block_k=32,
                                                                  group_m=1, num_warps=4, num_stages=1,
                                                                  in_tile=in_tile))


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("tokens", [3, 40])
def test_fp8_fused_experts_picked_tiles(tokens):
    """Tiles from the heuristic (block-scaled 16 x 32: BLOCK_K becomes the 32-column group): 40 tokens x top 2
    fill several 16-row blocks of one expert."""
    check_experts(tokens, 8, 2, 64, 48, SMALL["block16x32"], None)


def test_fp8_experts_take_the_fp8_table():
    """e4m3 experts of qwen3-30b-a3b's shape (TP 1 and 2) get FP8_CONFIGS' row for each token count, bf16
    ones CONFIGS' (the FP8 rows differ from the bf16 ones at least in BLOCK_K from 512 tokens)."""
    assert FP8_CONFIGS.keys() == CONFIGS.keys()
    for (experts, inter, hidden), rows in FP8_CONFIGS.items():
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn, device="meta")
        for tokens, config in rows:
            assert pick_config(tokens, 8, w13) == config
        bf16 = w13.to(torch.bfloat16)
        assert all(pick_config(tokens, 8, bf16) == config for tokens, config in CONFIGS[experts, inter, hidden])
        assert any(pick_config(tokens, 8, w13) != pick_config(tokens, 8, bf16) for tokens, _ in rows)


def check_experts(tokens: int, experts: int, top_k: int, hidden: int, inter: int, config: Fp8Config,
                  tiles: MoEConfig | None, dtype: torch.dtype = DTYPE, flips: int = 0,
                  kernel: Callable[..., torch.Tensor] = fused_experts) -> None:
    """`kernel` (`fused_experts`, or `moe_gemv` with tiles None) against `experts_torch`. `flips`: outputs allowed
    past TOL (within 5x its atol), for an activation moved to its neighbouring e4m3 value by the GPU's
    approximate division (see TOL)."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    w13, s13 = zip(*(quantize_weight(torch.randn(2 * inter, hidden, generator=gen, device=DEVICE) / hidden**0.5,
                                     config) for _ in range(experts)))
    w2, s2 = zip(*(quantize_weight(torch.randn(hidden, inter, generator=gen, device=DEVICE) / inter**0.5, config)
                   for _ in range(experts)))
    w13, s13, w2, s2 = (torch.stack(t) for t in (w13, s13, w2, s2))
    weights, ids = route(torch.randn(tokens, experts, generator=gen, device=DEVICE), top_k, True)
    out = kernel(x, w13, w2, weights, ids.to(torch.int32), tiles, scales=(s13, s2), fp8=config)
    ref = experts_torch(x, w13, w2, weights, ids, scales=(s13, s2), fp8=config)
    out, ref = out.float().cpu(), ref.float().cpu()
    if flips:
        off = (out - ref).abs() > TOL["atol"] + TOL["rtol"] * ref.abs()
        assert int(off.sum()) <= flips and torch.allclose(out, ref, rtol=TOL["rtol"], atol=5 * TOL["atol"])
        out = torch.where(off, ref, out)
    torch.testing.assert_close(out, ref, **TOL)
