"""FP8 (e4m3) weights in Triton: the activation quantization shared by every FP8 kernel, and the GEMM
of prefill-sized batches. The decode GEMV (`minisgl.kernels.gemv`) and the fused experts
(`minisgl.kernels.fused_moe`) take FP8 weights through the same helpers.

Each kernel steps through K one scale group (GROUP columns, the weight block's width) at a time,
multiplies e4m3 tiles on the FP8 tensor cores, and scales the float32 product by the row's activation
scale and the weight block's scale. `minisgl.layers.fp8.fp8_linear_torch` is the reference. The GEMV
quantizes its activation tile per row in registers (few rows, no extra launch), as the experts do where
their table says so (`fused_moe.MoEConfig.in_tile`); the GEMM and the other experts' rows quantize x once,
in a launch of its own, as each of their many column tiles would otherwise redo it and
the rounding, not the tensor cores, would bound it (on an H100, qwen3-8b FP8 W1 went from 4,103 to
7,070 tok/s with this change and the GEMV's larger tiles). The GEMM's tiles come from measured tables
(FP8_GEMM_CONFIGS); with them and its one multiply-add of scaling per element, W1 reached bf16's 7,646
tok/s (7,625) on the same H100.

Under TRITON_INTERPRET=1 (the CPU tests) the e4m3 rounding is done in float32 arithmetic and the dot
in float32: the interpreter's own float32 -> e4m3 cast mis-rounds values just below a power of two
(126.8 becomes 64, not 128). Both give the same e4m3 values and exact products.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.activation import silu_mul
from minisgl.quantization import Fp8Config

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 arithmetic."""
    a = tl.abs(v)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 0.015625))) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
    x = a / step
    r = tl.floor(x + 0.5)
    r = tl.where((r - x == 0.5) & (r % 2.0 == 1.0), r - 1.0, r)
    return tl.where(v < 0, -r * step, r * step)


@triton.jit
def quantize_tile(a, AXIS: tl.constexpr, EMULATE: tl.constexpr):
    """Scale each row (AXIS=1) or column (AXIS=0) of a tile so that its largest magnitude is 448 and round
    it to e4m3: (values, float32 scales that dequantize them)."""
    a = a.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(a), axis=AXIS), 1e-10) / 448.0
    v = tl.minimum(tl.maximum(a / tl.expand_dims(scale, AXIS), -448.0), 448.0)
    if EMULATE:
        q = _round_e4m3(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def dot_e4m3(a, b, EMULATE: tl.constexpr):
    """a @ b for e4m3 tiles on the FP8 tensor cores, exact products summed in float32 (emulated: in float32)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# M and M_OUT follow the step's token count: specialized (divisible by 16 or not), an odd count would compile a
# variant in the middle of serving (tests/gpu/test_fp8_kernels_full_size.py)
@triton.jit(do_not_specialize=["M", "M_OUT"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, ROWS: tl.constexpr, GROUP: tl.constexpr,
                     SILU_MUL: tl.constexpr, EMULATE: tl.constexpr):
    """One group of ROWS rows of x (SILU_MUL: of silu(gate) * up, x being [gate | up] with K columns each):
    their e4m3 values (float32 when emulated) and scales; rows from M up to M_OUT (padding) get zeros."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :]
    mask = (rows[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(x_ptrs + K, mask=mask, other=0.0))
    q, scale = quantize_tile(x, 1, EMULATE)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + k[None, :], q, mask=(rows[:, None] < M_OUT) & (k[None, :] < K))
    tl.store(s_ptr + g * M_OUT + rows, scale, mask=rows < M_OUT)


def quantize_activation(x: torch.Tensor, group: int, rows: int | None = None,
                        silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [rows, K], float32 scales [ceil(K / group), rows]), per token and group;
    `rows` (default M) may exceed M, the rows past M then being zeros (cuBLAS takes a padded batch: see
    `minisgl.kernels.fp8_cublas`). The scales are stored group-major, so that the GEMM reads a tile's rows of
    one group contiguously. With `silu_mul`, x is the MLP's [gate | up] [M, 2K] and what is quantized is
    `activation.silu_and_mul(x)`, the same values bit for bit (rounded to x's dtype first), without writing
    and reading them back (for qwen3-8b's down projection, an estimated ~3% of an FP8 prefill's time)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    if silu_mul:
        assert k % 2 == 0, "quantize_activation: with silu_mul, x is [gate | up] with an even column count"
        k //= 2
    rows = m if rows is None else rows
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float32 if EMULATE else torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(triton.cdiv(rows, 16), groups)](x, q, scale, m, rows, k, x.stride(0), ROWS=16, GROUP=group,
                                                          SILU_MUL=silu_mul, EMULATE=EMULATE)
    return q, scale


@triton.jit
def _fp8_gemm_kernel(x_ptr, sx_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_wn, stride_sn, stride_sk,
                     SCALE_ROWS: tl.constexpr, SCALE_ALONG_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y = x W^T from quantized x [M, K] and its scales [groups, M], K
    walked one scale group at a time.

    The float32 product of each group leaves the tensor cores to be scaled, so the scaling is kept to one
    multiply-add per element: where the tile's rows share one weight block (SCALE_ROWS a multiple of
    BLOCK_N, as 128 x 128 blocks with 64- or 128-row tiles) the weight scale is a scalar folded into the
    rows' activation scales; per-channel weight scales (not SCALE_ALONG_K) are applied once, after the loop."""
    pid = tl.program_id(0)  # consecutive programs share GROUP_M row tiles, so that W's tiles stay in L2
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * blocks_n) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_m
    pid_n = (pid % (GROUP_M * blocks_n)) // group_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, GROUP)
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * K + kk[None, :]
    w_ptrs = w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None]  # W^T: [GROUP, BLOCK_N]
    s_ptrs = s_ptr + (n // SCALE_ROWS) * stride_sn
    tile_scale = s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn  # the tile's one block row of scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        in_k = kk < K - g * GROUP
        x = tl.load(x_ptrs, mask=(m[:, None] < M) & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (n[None, :] < N), other=0.0)
        sx = tl.load(sx_ptr + g * M + m, mask=m < M, other=0.0)
        if not SCALE_ALONG_K:
            acc += dot_e4m3(x, w, EMULATE) * sx[:, None]
        elif SCALE_ROWS % BLOCK_N == 0:
            acc += dot_e4m3(x, w, EMULATE) * (sx * tl.load(tile_scale + g * stride_sk))[:, None]
        else:
            sw = tl.load(s_ptrs + g * stride_sk, mask=n < N, other=0.0)
            acc += dot_e4m3(x, w, EMULATE) * sx[:, None] * sw[None, :]
        x_ptrs += GROUP
        w_ptrs += GROUP
    if not SCALE_ALONG_K:
        acc *= tl.load(s_ptrs, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> ((largest M, tiles), ...) in ascending M; the last row serves every larger M. Rows from
# `python benchmarks/fp8.py --sweep --write` (which rewrites this table); shapes without rows take
# default_gemm_config.
FP8_GEMM_CONFIGS: dict[tuple[int, int], tuple[tuple[int, Fp8GemmConfig], ...]] = {
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 qkv M=128: 20.2 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 qkv M=256: 22.5 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 qkv M=4096: 296.5 us
    (6144, 4096): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (256, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=3)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 o M=128: 18.6 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 o M=256: 19.6 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 o M=4096: 211.8 us
    (4096, 4096): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (256, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 gate_up M=128: 51.8 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 gate_up M=256: 74.6 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 gate_up M=4096: 1118.7 us
    (24576, 4096): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (256, Fp8GemmConfig(block_m=128, block_n=64, group_m=8, num_warps=8, num_stages=4)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 down M=128: 51.9 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 down M=256: 55.7 us
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 down M=4096: 604.0 us
    (4096, 12288): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=3)),
        (256, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=128: 11.7 us
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=256: 12.8 us
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=4096: 125.3 us
    (5120, 2048): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (256, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=3)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=128: 18.3 us
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=256: 18.8 us
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=4096: 100.2 us
    (2048, 4096): (
        (128, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (256, Fp8GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)),
        (4096, Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=8, num_stages=3)),
    ),
}


def default_gemm_config(m: int) -> Fp8GemmConfig:
    """Small batches take short row tiles so that more programs share the weight read."""
    if m <= 64:
        return Fp8GemmConfig(block_m=64, block_n=128, num_stages=4)
    return Fp8GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=4)


def pick_config(m: int, n: int, k: int) -> Fp8GemmConfig:
    """The measured tiles of the smallest M row at or above m (the largest row beyond), else the default."""
    rows = FP8_GEMM_CONFIGS.get((n, k))
    if not rows:
        return default_gemm_config(m)
    return next((tiles for max_m, tiles in rows if m <= max_m), rows[-1][1])


def scale_strides(scale: torch.Tensor, config: Fp8Config) -> tuple[int, int]:
    """(row, group) strides of a weight's scales; a per-channel scale repeats along K (stride 0)."""
    return scale.stride(-2), scale.stride(-1) if config.block else 0


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
             bias: torch.Tensor | None = None, tiles: Fp8GemmConfig | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """`fp8_linear_torch(x, w, scale, config, bias)` for x [M, K], e4m3 w [N, K]: output [M, N] in x's dtype.
    With `silu_mul`, x is the MLP's [gate | up] [M, 2K] and silu_and_mul(x) is multiplied (formed while
    quantizing it)."""
    m = x.shape[0]
    n, k = w.shape
    assert x.shape[1] == (2 * k if silu_mul else k) and w.stride(1) == 1, \
        "fp8_gemm: x [M, K] ([M, 2K] with silu_mul), w [N, K] with unit stride along K"
    tiles = tiles or pick_config(m, n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    xq, sx = quantize_activation(x, config.group, silu_mul=silu_mul)
    stride_sn, stride_sk = scale_strides(scale, config)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _fp8_gemm_kernel[grid](xq, sx, w, scale, bias if bias is not None else out, out, m, n, k, w.stride(0),
                           stride_sn, stride_sk, SCALE_ROWS=config.scale_rows, SCALE_ALONG_K=config.block is not None,
                           HAS_BIAS=bias is not None, EMULATE=EMULATE, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                           GROUP=config.group, GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
                           num_stages=tiles.num_stages)
    return out
