"""Mixture-of-experts for a few tokens (decode at batch 1..8) in two launches, without the align step.

At one token the fused MoE (`minisgl.kernels.fused_moe`) is a chain of small launches: align, (FP8)
quantize, gate/up GEMM, quantize, down GEMM, a sum over top_k. Each costs a launch gap and a tail, and
together they took 33 us per layer (FP8, qwen3-30b-a3b on an H200) where reading the 8 experts' weights
takes ~8 us. With a few tokens there is nothing to gain from grouping pairs by expert, so each pair is a
GEMV of its own, on the decode GEMV's steps (`minisgl.kernels.gemv._gemv_step`: x padded to 16 rows by
masked loads on the tensor cores; FP8 weights with x quantized per token and group in registers):

1. gate/up: one program per (pair, column tile of I): the pair's expert from ids, its token's row of x
   times the expert's gate and up rows, silu(gate) * up in float32 -> act [T * top_k, I] in x's dtype.
2. down: one program per (token, column tile of H, group of slots), looping over its share of the token's
   top_k experts in slot order: out[t] = sum_k weight_k * (act[t, k] @ w2[e_k].T), summed in float32 and
   rounded once. With several groups (more programs, more loads in flight at one token) the last group to
   arrive adds the groups' float32 sums in group order, as the split-K GEMV does: deterministic (a fixed
   order; the one atomic counts arrivals), and no separate sum over top_k.

The same numbers as `experts_torch` up to the order of float32 sums (FP8: the same e4m3 activations, per
token and 128-column group, as `fp8_linear_torch`). No host sync and no argument that changes with T (T
is the grid's first dimension), so it is captured in CUDA graphs and compiles once per model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.arrival import last_to_arrive
from minisgl.kernels.fp8 import EMULATE, scale_strides
from minisgl.kernels.gemv import BLOCK_M, COUNTER_SLOTS, _gemv_step, arrival_counters
from minisgl.quantization import Fp8Config

# The largest token count SparseMoE sends here (the fused MoE above it): set from `benchmarks/moe.py`.
# MINISGL_SMALL_MOE_MAX_TOKENS overrides it (0: never), for A/B runs of whole models.
# On an H100 (qwen3-30b-a3b FP8, TP 1, the default tiles): 1 token 0.0277 against the fused MoE's 0.0321 ms a
# layer; 2 tokens 0.0429 against 0.0438 (even); 4 tokens 0.0730 against 0.0699.
SMALL_MOE_MAX_TOKENS = int(os.environ.get("MINISGL_SMALL_MOE_MAX_TOKENS", "1"))


@dataclass(frozen=True)
class MoeGemvConfig:
    """Column tiles of the two kernels and the K step (FP8: the scale group). At one token the gate/up GEMV
    has top_k * I / up_block_n programs and the down GEMV H / down_block_n * down_split: narrow tiles and
    split slots keep more weight loads in flight. The defaults: the fastest of `benchmarks/moe.py --fp8
    --small-sweep` at one token on an H100 (qwen3-30b-a3b, TP 1); a manual prefetch of the next weight tile
    (two loads in flight a program) was slower in every one of its top three at 1-8 tokens, so it is gone."""

    up_block_n: int = 64
    down_block_n: int = 32
    down_split: int = 8  # slot groups of the down GEMV (a divisor of top_k, else 1), reduced in the launch
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def use_moe_gemv(num_tokens: int) -> bool:
    """Whether a batch of num_tokens takes this path rather than the fused MoE."""
    return 1 <= num_tokens <= SMALL_MOE_MAX_TOKENS


@triton.jit
def _weight_tile(ptrs, rows_ok, cols_ok):
    """One [BLOCK_N, BLOCK_K] weight tile (zeros outside the rows and columns that are ok), read once:
    evicted first, so that the activations stay in the caches."""
    return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, N, K, stride_xm, stride_we, stride_wn,
                    stride_se, stride_sn, stride_sk, TOP_K: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                    FP8: tl.constexpr, SCALE_ALONG_K: tl.constexpr, EMULATE: tl.constexpr):
    """act[pair, n] = silu(x[token] . gate[n]) * (x[token] . up[n]) for one BLOCK_N tile of n; the expert's
    w13 holds N gate rows then N up rows (scales likewise: N is a multiple of SCALE_ROWS)."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)  # only row 0 is loaded: the pair's token
    kk = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm + m[None, :] * stride_xm + kk[:, None]
    s_gate = s_ptr + expert * stride_se
    s_up = s_gate + N // SCALE_ROWS * stride_sn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        gate = _weight_tile(gate_ptrs, n < N, k + kk < K)
        up = _weight_tile(up_ptrs, n < N, k + kk < K)
        acc_gate = _gemv_step(acc_gate, gate, x_ptrs, k, K, kk, m, n, pid_n, 1, N, K, s_gate, stride_sn, stride_sk,
                              PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_ROWS, FP8, SCALE_ALONG_K, False, EMULATE)
        acc_up = _gemv_step(acc_up, up, x_ptrs, k, K, kk, m, n, pid_n, 1, N, K, s_up, stride_sn, stride_sk,
                            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_ROWS, FP8, SCALE_ALONG_K, False, EMULATE)
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    g = tl.sum(acc_gate, axis=1)  # the padding columns of x are zeros: the sums are column 0
    u = tl.sum(acc_up, axis=1)
    if FP8 and not SCALE_ALONG_K:  # per-channel weight scales, once after the loop
        g *= tl.load(s_gate + n * stride_sn, mask=n < N, other=0.0)
        u *= tl.load(s_up + n * stride_sn, mask=n < N, other=0.0)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + pair.to(tl.int64) * N + n, act.to(act_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr, partial_ptr, counter_ptr, N, K, stride_we,
                 stride_wn, stride_se, stride_sn, stride_sk, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                 SPLIT: tl.constexpr, SLOTS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr, FP8: tl.constexpr,
                 SCALE_ALONG_K: tl.constexpr, EMULATE: tl.constexpr):
    """out[token, n] = sum over the token's slots j of weights[j] * (act[pair j] . w2[expert j][n]), for one
    BLOCK_N tile of n, the slots in order, in one loop over (slot, K step).
    SPLIT > 1: the slots are shared out in SPLIT groups of SLOTS (grid axis 2; more programs keep more loads
    in flight at one token); each group's float32 sum goes to partial [T, SPLIT, N] and the last group to
    arrive adds them in group order."""
    token, pid_n, group = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, K_POW2)
    first = token * TOP_K + group * SLOTS  # the group's first pair
    experts = tl.load(ids_ptr + first + slots, mask=slots < SLOTS, other=0).to(tl.int64)
    routed = tl.load(weights_ptr + first + slots, mask=slots < SLOTS, other=0.0)
    k_steps = tl.cdiv(K, BLOCK_K)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    steps = SLOTS * k_steps
    for step in range(0, steps):
        j = step // k_steps  # the slot
        k = (step - j * k_steps) * BLOCK_K
        expert = tl.sum(tl.where(slots == j, experts, 0), axis=0)
        w = _weight_tile(w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn + (k + kk)[None, :],
                         n < N, k + kk < K)
        x_ptrs = act_ptr + (first + j) * K + m[None, :] * K + (k + kk)[:, None]
        s_expert = s_ptr + expert * stride_se
        acc = _gemv_step(acc, w, x_ptrs, k, K, kk, m, n, pid_n, 1, N, K, s_expert, stride_sn, stride_sk,
                         PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_ROWS, FP8, SCALE_ALONG_K, False, EMULATE)
        if k + BLOCK_K >= K:  # the slot's last step: add its weighted output
            y = tl.sum(acc, axis=1)
            if FP8 and not SCALE_ALONG_K:
                y *= tl.load(s_expert + n * stride_sn, mask=n < N, other=0.0)
            out += tl.sum(tl.where(slots == j, routed, 0.0), axis=0) * y
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SPLIT > 1:
        tl.store(partial_ptr + (token * SPLIT + group) * N + n, out, mask=n < N)
        counter = counter_ptr + token * tl.num_programs(1) + pid_n
        last = last_to_arrive(counter, SPLIT)
        if last:
            out = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for g in range(SPLIT):  # group order, whichever group arrived last
                out += tl.load(partial_ptr + (token * SPLIT + g) * N + n, mask=n < N, other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)
    else:
        last = True
    if last:
        tl.store(out_ptr + token * N + n, out.to(out_ptr.dtype.element_ty), mask=n < N)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             config: MoeGemvConfig | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             fp8: Fp8Config | None = None) -> torch.Tensor:
    """`experts_torch` (and `fused_experts`) for a few tokens: x [T, H], w13 [E, 2 * I, H] (gate rows then
    up rows), w2 [E, H, I], weights/ids [T, top_k] -> [T, H]; e4m3 experts come with their (w13, w2)
    `scales` and `fp8` settings (BLOCK_K is then the scale group)."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w2.shape[2]
    assert w13.shape[1:] == (2 * inter, hidden) and w13.stride(2) == 1 and w2.stride(2) == 1, \
        "moe_gemv: w13 [E, 2I, H], w2 [E, H, I], unit stride along K"
    assert (fp8 is None) == (w13.dtype == x.dtype), "moe_gemv: experts of x's dtype, or e4m3 with their scales"
    assert fp8 is None or inter % fp8.scale_rows == 0, "moe_gemv: the up rows' scales start on a block boundary"
    config = config or MoeGemvConfig()
    x = x if x.stride(1) == 1 else x.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    common = dict(TOP_K=top_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M,
                  SCALE_ROWS=fp8.scale_rows if fp8 else 1, FP8=fp8 is not None,
                  SCALE_ALONG_K=fp8 is not None and fp8.block is not None, EMULATE=EMULATE,
                  num_warps=config.num_warps, num_stages=config.num_stages)

    def block_k(k: int) -> int:
        return fp8.group if fp8 else min(config.block_k, max(16, triton.next_power_of_2(k)))

    def scale_args(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int]:
        """The scale pointer and its (expert, row, group) strides; w itself (never read) without FP8."""
        if fp8 is None:
            return w, 0, 0, 0
        return scale, scale.stride(0), *scale_strides(scale, fp8)

    s13, s2 = scales or (None, None)
    s_ptr, *s_strides = scale_args(w13, s13)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, config.up_block_n))](
        x, w13, s_ptr, ids, act, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), *s_strides,
        BLOCK_N=config.up_block_n, BLOCK_K=block_k(hidden), **common)
    s_ptr, *s_strides = scale_args(w2, s2)
    split = config.down_split if top_k % config.down_split == 0 else 1
    tiles = triton.cdiv(hidden, config.down_block_n)
    partial, counters = out, out  # unused without a split
    if split > 1:
        assert num_tokens * tiles <= COUNTER_SLOTS, "moe_gemv: more down tiles than split-K counters"
        partial = torch.empty(num_tokens, split, hidden, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device)
    _down_kernel[(num_tokens, tiles, split)](
        act, w2, s_ptr, ids, weights, out, partial, counters, hidden, inter, w2.stride(0), w2.stride(1), *s_strides,
        K_POW2=triton.next_power_of_2(top_k), SPLIT=split, SLOTS=top_k // split, BLOCK_N=config.down_block_n,
        BLOCK_K=block_k(inter), **common)
    return out
