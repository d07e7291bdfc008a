"""Split-K GEMV for decode: y = x W^T (+ b) for a few rows of x (M <= 16) and a large weight W [N, K].

At decode batch sizes a linear layer is a weight read: each element of W is used M times, so the
kernel is as fast as it streams W from HBM. cuBLAS tiles these shapes for larger M: on an H200 it took
12.7 us for qwen3-0.6b's o projection at M = 1 (a 4 MB weight) where this kernel takes 4.9 us, and it is
a few percent slower on most other decode projections (the measured rows in CONFIGS).

Each program reads one [BLOCK_N, BLOCK_K] strip of W per step and multiplies it with all M rows at once
on the tensor cores (x padded to 16 rows by masked loads); programs are spread over the N tiles and,
where N alone gives too few to fill the GPU, over SPLIT_K slices of K.

The split-K partial sums are reduced in a fixed order, in the same launch: every program writes its
float32 partial to a workspace and counts its arrival on its tile's counter; the last to arrive adds
the SPLIT_K partials in slice order (so the result does not depend on which program came last), adds
the bias, writes the output and sets the counter back to zero for the next call or graph replay.
Atomic adds into a zeroed float32 buffer would need a memset and a cast (two more launches) and vary
from run to run; a separate reduction pass adds a launch, which at these sizes costs as much as the
GEMV itself.

FP8 weights (e4m3 with block or per-channel scales, see `minisgl.kernels.fp8`) halve the bytes streamed:
BLOCK_K is then the scale group; each program quantizes its slice of x per row and group in registers
and scales each group's product by the activation and weight scales (one scalar weight scale per step
where the tile's rows sit in one weight block; per-channel scales once, after the loop). FP8 layers take
this kernel up to its 16 rows: on an H100 qwen3-8b's projections took 3.2 ms a decode step here at 16 rows
against 4.5 ms in the FP8 GEMM, while 64-row tiles (tried) took 8.1 ms against the GEMM's 4.7
(benchmarks/fp8.py). Leaving x unquantized and widening the weights instead was slower at one row on the
same kind of H100: 3.65 ms a step on the CUDA cores, 4.30 on the tensor cores, against this kernel's 3.18.

On Hopper the kernel is launched as a programmatic dependent (`minisgl.kernels.use_pdl`): it reads its first
weight tile while the kernel before it finishes and waits (griddepcontrol.wait) only before reading x. With
`silu_mul` it reads a merged [gate | up] projection and forms the MLP's activation per step, saving that
kernel's launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels import use_pdl
from minisgl.kernels.activation import silu_mul
from minisgl.kernels.arrival import last_to_arrive
from minisgl.kernels.fp8 import EMULATE, dot_e4m3, quantize_tile, scale_strides
from minisgl.quantization import Fp8Config

BLOCK_M = 16  # rows of x per program; one compiled kernel serves every M up to it
GEMV_MAX_M = 8  # the largest decode batch routed here (the CUDA-graph buckets 1, 2, 4, 8)
COUNTER_SLOTS = 1 << 14  # arrival counters per device: one per N tile of a split-K launch
TARGET_PROGRAMS = 256  # about two programs per SM of an H100/H200 (132 SMs)


@triton.jit
def _gemv_step(acc, w, x_ptrs, k, k_stop, kk, m, n, pid_n, M, N, K, s_ptr, stride_sn, stride_sk,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SCALE_ROWS: tl.constexpr, FP8: tl.constexpr, SCALE_ALONG_K: tl.constexpr, SILU_MUL: tl.constexpr,
               EMULATE: tl.constexpr):
    """One BLOCK_K step: this program's weight tile w times x's columns k.. added into acc."""
    in_k = k + kk < k_stop
    xt = tl.load(x_ptrs, mask=in_k[:, None] & (m[None, :] < M), other=0.0)
    if SILU_MUL:  # x is [gate | up]: this step's silu(gate) * up, rounded as activation.silu_and_mul does
        xt = silu_mul(xt, tl.load(x_ptrs + K, mask=in_k[:, None] & (m[None, :] < M), other=0.0))
    if FP8:  # x's group k.. quantized per row in registers; one scale group per step, k a multiple of BLOCK_K
        xq, sx = quantize_tile(xt, 0, EMULATE)
        if not SCALE_ALONG_K:  # per-channel: the weight scales are applied once, after the loop
            scale = sx[None, :]
        elif SCALE_ROWS % BLOCK_N == 0:  # the tile's rows share one weight block: a scalar weight scale
            sw = tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn + k // BLOCK_K * stride_sk)
            scale = (sx * sw)[None, :]
        else:
            sw = tl.load(s_ptr + (n // SCALE_ROWS) * stride_sn + k // BLOCK_K * stride_sk, mask=n < N, other=0.0)
            scale = sw[:, None] * sx[None, :]
        acc += dot_e4m3(w, xq, EMULATE) * scale
    else:
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, k_per_split, split_k,
                 stride_xm, stride_wn, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 s_ptr, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr, FP8: tl.constexpr,
                 SCALE_ALONG_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, EMULATE: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + (k_start + kk)[None, :]
    x_ptrs = x_ptr + m[None, :] * stride_xm + (k_start + kk)[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T of this tile
    if PDL:  # launched before the previous kernel ends: read the first weight tile (no kernel writes W) while
        # it finishes, let the next kernel launch likewise, and wait for the previous one before reading x
        w = tl.load(w_ptrs, mask=(n[:, None] < N) & (kk < k_stop - k_start)[None, :], other=0.0,
                    eviction_policy="evict_first")
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        acc = _gemv_step(acc, w, x_ptrs, k_start, k_stop, kk, m, n, pid_n, M, N, K, s_ptr, stride_sn,
                         stride_sk, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_ROWS, FP8, SCALE_ALONG_K, SILU_MUL,
                         EMULATE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    for k in range(k_start + PDL * BLOCK_K, k_stop, BLOCK_K):
        w = tl.load(w_ptrs, mask=(n[:, None] < N) & (k + kk < k_stop)[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = _gemv_step(acc, w, x_ptrs, k, k_stop, kk, m, n, pid_n, M, N, K, s_ptr, stride_sn,
                         stride_sk, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_ROWS, FP8, SCALE_ALONG_K, SILU_MUL,
                         EMULATE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if FP8 and not SCALE_ALONG_K:
        acc *= tl.load(s_ptr + n * stride_sn, mask=n < N, other=0.0)[:, None]

    tile = m[None, :] * N + n[:, None]  # offsets of y^T's elements in a row-major [M, N]
    in_tile = (n[:, None] < N) & (m[None, :] < M)
    if SPLIT:
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=in_tile)
        last = last_to_arrive(counter_ptr + pid_n, split_k)
        if last:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(split_k):  # slice order, whichever slice arrived last
                acc += tl.load(partial_ptr + s * M * N + tile, mask=in_tile, other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + pid_n, 0)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=in_tile)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> config, for the decode projections of qwen3-0.6b and qwen3-8b at TP 1 and 2. A shape is
# routed to the kernel (use_gemv) only when it has a row here: keep only rows that `python
# benchmarks/gemv.py --sweep` measured faster than F.linear, and paste its printed rows over these.
CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # Measured on one H200 (benchmarks/gemv.py --sweep --tp 1 2, bf16, CUDA-graph replay, weights from HBM):
    # qwen3-0.6b TP1 qkv: M=1 5.0 vs 5.2 us, M=8 5.1 vs 5.2 us (gemv vs F.linear)
    (4096, 1024): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-0.6b TP1 o: M=1 4.9 vs 12.7 us, M=8 5.0 vs 5.8 us (gemv vs F.linear)
    (1024, 2048): GemvConfig(block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=3),
    # qwen3-0.6b TP1 gate_up: M=1 5.7 vs 5.9 us, M=8 5.9 vs 5.9 us (gemv vs F.linear)
    (6144, 1024): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-0.6b TP1 down: M=1 5.3 vs 7.4 us, M=8 5.6 vs 7.4 us (gemv vs F.linear)
    (1024, 3072): GemvConfig(block_n=64, block_k=256, split_k=8, num_warps=4, num_stages=3),
    # qwen3-0.6b TP1 lm_head: M=1 70.4 vs 74.8 us, M=8 73.5 vs 77.1 us (gemv vs F.linear)
    (151936, 1024): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # qwen3-0.6b TP2 qkv: M=1 4.4 vs 4.7 us, M=8 4.5 vs 4.7 us (gemv vs F.linear)
    (2048, 1024): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-0.6b TP2 o: M=1 4.1 vs 7.5 us, M=8 4.1 vs 4.4 us (gemv vs F.linear)
    (1024, 1024): GemvConfig(block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=3),
    # qwen3-0.6b TP2 gate_up: M=1 4.6 vs 5.0 us, M=8 4.8 vs 5.0 us (gemv vs F.linear)
    (3072, 1024): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-0.6b TP2 down: M=1 4.6 vs 9.1 us, M=8 4.8 vs 5.1 us (gemv vs F.linear)
    (1024, 1536): GemvConfig(block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=3),
    # qwen3-0.6b TP2 lm_head: M=1 36.9 vs 39.4 us, M=8 38.3 vs 40.4 us (gemv vs F.linear)
    (75968, 1024): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # qwen3-8b TP1 qkv: M=1 15.1 vs 16.6 us, M=8 15.3 vs 15.8 us (gemv vs F.linear)
    (6144, 4096): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-8b TP1 o: M=1 11.1 vs 13.0 us, M=8 11.3 vs 13.0 us (gemv vs F.linear)
    (4096, 4096): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    # qwen3-8b TP1 gate_up: M=1 47.5 vs 48.0 us, M=8 47.9 vs 53.6 us (gemv vs F.linear)
    (24576, 4096): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # qwen3-8b TP1 down: M=1 26.4 vs 30.2 us, M=8 26.8 vs 30.1 us (gemv vs F.linear)
    (4096, 12288): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    # qwen3-8b TP1 lm_head: M=1 270.8 vs 285.2 us, M=8 275.2 vs 288.3 us (gemv vs F.linear)
    (151936, 4096): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # qwen3-8b TP2 qkv: M=1 9.6 vs 11.6 us, M=8 9.7 vs 11.7 us (gemv vs F.linear)
    (3072, 4096): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    # qwen3-8b TP2 o: M=1 7.4 vs 7.1 us, M=8 7.5 vs 7.0 us (gemv vs F.linear)
    # (4096, 2048): GemvConfig(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=3),
    # qwen3-8b TP2 gate_up: M=1 25.7 vs 27.2 us, M=8 26.2 vs 27.6 us (gemv vs F.linear)
    (12288, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # qwen3-8b TP2 down: M=1 15.1 vs 17.1 us, M=8 15.5 vs 17.8 us (gemv vs F.linear)
    (4096, 6144): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    # qwen3-8b TP2 lm_head: M=1 138.3 vs 142.3 us, M=8 139.8 vs 143.6 us (gemv vs F.linear)
    (75968, 4096): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
}


# The same for e4m3 weights (BLOCK_K is the scale group, 128): rows from `benchmarks/fp8.py --sweep` (qwen3-8b's
# on an H100, qwen3-30b-a3b's attention projections on an H200; csrc's GEMVs serve most of them at 1-2 rows).
FP8_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 qkv: M=1 13.6 us, M=8 13.3 us
    (6144, 4096): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 o: M=1 10.3 us, M=8 10.5 us
    (4096, 4096): GemvConfig(block_n=128, block_k=128, split_k=4, num_warps=8, num_stages=4),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 gate_up: M=1 40.0 us, M=8 40.9 us
    (24576, 4096): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # NVIDIA H100 80GB HBM3 qwen3-8b TP1 down: M=1 23.4 us, M=8 24.0 us
    (4096, 12288): GemvConfig(block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=3),
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv: M=1 6.6 us, M=8 7.0 us
    (5120, 2048): GemvConfig(block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=3),
    # NVIDIA H200 qwen3-30b-a3b TP1 o: M=1 7.1 us, M=8 7.1 us
    (2048, 4096): GemvConfig(block_n=64, block_k=128, split_k=16, num_warps=8, num_stages=4),
}


def default_config(n: int, k: int, block_n: int = 32, block_k: int = 256) -> GemvConfig:
    """Tiles of 32 rows x 256 columns (FP8: 128 rows x one scale group, the same 16 KB a step); K is split
    in powers of two until there are TARGET_PROGRAMS programs or a slice is down to one K tile."""
    tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split_k = 1
    while tiles * split_k < TARGET_PROGRAMS and k_tiles >= 2 * split_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k)


def use_gemv(m: int, n: int, k: int) -> bool:
    """Whether y = x W^T with x [m, k] and W [n, k] should run here rather than in cuBLAS: a decode-sized
    batch and a weight shape the benchmark measured faster (it has a row in CONFIGS)."""
    return 1 <= m <= GEMV_MAX_M and (n, k) in CONFIGS


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed split-K counters, created on first use. Each launch leaves them zero again, so
    one buffer serves every launch on the device's stream, eager or replayed. It must exist before a CUDA
    graph captures a launch (a capture records the zeroing but does not run it)."""
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: run one split-K launch on this device before capturing a CUDA graph "
                               "(its counters cannot be created inside a capture)")
        _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _counters[device]


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None,
         fp8: Fp8Config | None = None, silu_mul: bool = False) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K] with M <= 16, w [N, K] with unit stride along K, bias [N]; float32
    accumulation, output [M, N] in x's dtype. `config` overrides CONFIGS and default_config. An e4m3 w
    comes with its `scale` and `fp8` settings: the result is then `fp8_linear_torch`'s. With `silu_mul`, x is
    a merged [gate | up] projection [M, 2K] and the product is `silu_and_mul(x)` W^T: the MLP's activation
    without a launch."""
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    assert x.shape[1] == (2 if silu_mul else 1) * k and w.stride(1) == 1, \
        "gemv: x [M, K] (silu_mul: [M, 2K]), w [N, K] with unit stride along K"
    assert (x.dtype == w.dtype) == (fp8 is None), "gemv: w of x's dtype, or e4m3 with its scales"
    assert 1 <= m <= BLOCK_M, f"gemv takes 1..{BLOCK_M} rows, got {m}"
    config = config or (FP8_CONFIGS.get((n, k)) or default_config(n, k, 128, fp8.group) if fp8 else
                        CONFIGS.get((n, k)) or default_config(n, k))
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = fp8.group if fp8 else min(config.block_k, max(16, triton.next_power_of_2(k)))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # slices that would be empty after rounding are dropped
    tiles = triton.cdiv(n, config.block_n)
    stride_sn, stride_sk = scale_strides(scale, fp8) if fp8 else (0, 0)
    split = split_k > 1
    if split:
        assert tiles <= COUNTER_SLOTS, f"gemv: {tiles} N tiles exceed the {COUNTER_SLOTS} split-K counters"
        partial, counters = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device), arrival_counters(
            x.device)
    else:
        partial, counters = out, out  # unused
    pdl = use_pdl(x.device)
    _gemv_kernel[(tiles, split_k)](
        x, w, bias if bias is not None else out, out, partial, counters, m, n, k, k_per_split, split_k,
        x.stride(0), w.stride(0), HAS_BIAS=bias is not None, SPLIT=split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
        BLOCK_K=block_k, s_ptr=scale if fp8 else out, stride_sn=stride_sn, stride_sk=stride_sk,
        SCALE_ROWS=fp8.scale_rows if fp8 else 1, FP8=fp8 is not None,
        SCALE_ALONG_K=fp8 is not None and fp8.block is not None, SILU_MUL=silu_mul, PDL=pdl, EMULATE=EMULATE,
        num_warps=config.num_warps, num_stages=config.num_stages, **({"launch_pdl": True} if pdl else {}))
    return out
