"""Fused mixture-of-experts in Triton: the GPU path of `minisgl.layers.moe.experts_torch`.

Three steps, no host sync (the decode step runs inside CUDA graphs), no Python loop over experts:

1. align: sort the T * top_k (token, k) pairs by expert and pad each expert's run to BLOCK_M, so that
   every block of BLOCK_M sorted rows belongs to one expert. Buffers and grids are sized from upper
   bounds known on the host; the real number of padded rows stays on the device and programs past it
   exit at once.
2. gate/up: for each block, gather its tokens' activations, multiply by that expert's w13 and apply
   SiLU(gate) * up in the epilogue -> one row of [T * top_k, I] per pair.
3. down: multiply by the expert's w2 and by the pair's routing weight -> [T * top_k, H]; a sum over
   top_k gives [T, H] (a launch of its own: a token's pairs are in blocks of different experts, and
   summing them in the GEMM would take float atomics). Every step is deterministic: no atomics, a fixed
   summation order.

FP8 experts (e4m3 weights with block or per-channel scales) run through the same two GEMMs with BLOCK_K
set to the scale group, on e4m3 activations: x is quantized per token and group once before the gate/up
GEMM, and its output once before the down GEMM (`minisgl.kernels.fp8.quantize_activation`, one launch
each), so that no column block of a GEMM re-quantizes the rows it shares with the others (the gate/up
GEMM has I / BLOCK_N of them); each group's product is scaled by the activation and weight scales. Their
tiles come from a table of their own (FP8_CONFIGS: an e4m3 weight tile is half the bytes of a bf16 one),
whose rows may instead quantize the activations in the tiles (MoEConfig.in_tile: no extra launches, for
the smallest batches).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8 import EMULATE, dot_e4m3, quantize_activation, quantize_tile, scale_strides
from minisgl.quantization import Fp8Config

# Align: the pairs are split over programs of up to PAIRS_PER_PROGRAM each. A pair's rank within its expert
# (how many earlier pairs of its program chose the same expert) is a [chunk, chunk] compare tile, so the chunk
# stays small. Up to ONE_LAUNCH_MAX_TOKENS tokens (decode batches), every program histograms all the pairs
# itself (tl.histogram): one launch. More (prefills) are counted by a launch of their own on at most
# MAX_ALIGN_PROGRAMS programs, whose counts the placing programs read as one [MAX_ALIGN_PROGRAMS, experts] tile
# whatever their number.
# Arguments that change with the batch are not specialized: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16, a power of two) in the middle of serving, after the warm-up (seconds each). The
# threshold counts tokens, not pairs, so that the warm-up's prefills (`scheduler.WARM_UP_LENGTHS`, up to 1,536
# tokens) compile both ways whatever top_k is.
# Timed on an H100 (`benchmarks/moe.py --align-sweep`, 2026-11-26), us per call against the align this one
# replaced: 200 tokens x top-8 5.2 / 14.6, 1,024 tokens 8.3 / 16.2, 16,384 tokens 26.2 / 74.3. 64 pairs a
# program is the best counted split at every size; one launch at 32 would save ~1 us up to 512 tokens.
PAIRS_PER_PROGRAM = 64
ONE_LAUNCH_MAX_TOKENS = 512
MAX_ALIGN_PROGRAMS = 128
MAX_CHUNK = 128  # largest rank tile: [MAX_CHUNK, MAX_CHUNK]
HISTOGRAM_CHUNK = 2048  # pairs histogrammed at a time (all of a decode batch of 256 x top-8)
BLOCK_TILE = 32  # blocks whose expert is looked up at a time, as a [BLOCK_TILE, experts] compare


@triton.jit(do_not_specialize=["num_pairs", "pairs_per_program"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, pairs_per_program, E_POW2: tl.constexpr, SCAN: tl.constexpr):
    """Per-program expert counts, for the two-launch align of large batches."""
    pid = tl.program_id(0)
    start = pid * pairs_per_program
    stop = tl.minimum(start + pairs_per_program, num_pairs)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for base in range(start, stop, SCAN):
        offs = base + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + offs, mask=offs < stop, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_POW2, mask=offs < stop)
    tl.store(counts_ptr + pid * E_POW2 + tl.arange(0, E_POW2), counts)


@triton.jit(do_not_specialize=["num_pairs", "pairs_per_program", "num_programs", "max_blocks", "blocks_per_program"])
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                  num_pairs, pairs_per_program, num_programs, max_blocks, blocks_per_program,
                  BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, P_POW2: tl.constexpr, CHUNK: tl.constexpr,
                  SCAN: tl.constexpr, BLOCKS: tl.constexpr, COUNTED: tl.constexpr):
    """Write each of this program's pairs at its sorted, padded row, and, for this program's share of
    the blocks, their expert and the padding sentinels of their rows; program 0 writes the padded total.
    COUNTED: the per-program counts are at counts_ptr (`_count_kernel`); else this program histograms
    the pairs before its own and the rest."""
    pid = tl.program_id(0)
    start = pid * pairs_per_program
    stop = tl.minimum(start + pairs_per_program, num_pairs)
    if COUNTED:
        progs = tl.arange(0, P_POW2)[:, None]
        experts = tl.arange(0, E_POW2)[None, :]
        counts = tl.load(counts_ptr + progs * E_POW2 + experts, mask=progs < num_programs, other=0)
        totals = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(progs < pid, counts, 0), axis=0)  # each expert's pairs in earlier programs
    else:  # one pass over all the pairs (decode batches: one tile)
        before = tl.zeros([E_POW2], dtype=tl.int32)
        totals = tl.zeros([E_POW2], dtype=tl.int32)
        for base in range(0, num_pairs, SCAN):
            offs = base + tl.arange(0, SCAN)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32)
            before += tl.histogram(ids, E_POW2, mask=offs < start)
            totals += tl.histogram(ids, E_POW2, mask=offs < num_pairs)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    num_padded = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)

    # Block b starts at row b * BLOCK_M; its expert is the number of runs that end at or before it, and
    # its rows from that expert's last pair on are padding.
    first_block = pid * blocks_per_program
    last_block = tl.minimum(first_block + blocks_per_program, max_blocks)
    fill = starts + totals
    for first in range(first_block, last_block, BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        used = (blocks < last_block) & (blocks * BLOCK_M < num_padded)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, expert, mask=used)
        rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        pad = rows >= tl.gather(fill, tl.minimum(expert, E_POW2 - 1), 0)[:, None]
        tl.store(sorted_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=pad & used[:, None])

    cursor = starts + before  # next free row of each expert's run
    lanes = tl.arange(0, CHUNK)
    for base in range(start, stop, CHUNK):
        offs = base + lanes
        ok = offs < stop
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        # Masked lanes come last, so no pair in use counts one of them as earlier.
        earlier = tl.sum(((ids[None, :] == ids[:, None]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + tl.gather(cursor, ids, 0) + earlier, offs, mask=ok)
        cursor += tl.histogram(ids, E_POW2, mask=ok)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                  K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token: softmax over its experts in float32, then the top k by repeated argmax (ties to the
    lower expert id), highest first, optionally renormalised."""
    row = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    x = tl.load(logits_ptr + row * stride + experts, mask=experts < num_experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, experts, E_POW2), axis=0)
        weights = tl.where(slots == k, best, weights)
        ids = tl.where(slots == k, pick, ids)
        p = tl.where(experts == pick, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`minisgl.layers.moe.route` in one launch: weights [T, top_k] float32 and ids [T, top_k] int32
    (the torch path's softmax, top-k sort and renormalisation are five launches)."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                 K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(num_experts),
                                 RENORMALIZE=renormalize)
    return weights, ids


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m): at most one partial block per expert that got a pair."""
    return num_pairs // block_m + min(num_pairs, num_experts)


def align(ids: torch.Tensor, num_experts: int, block_m: int, pairs_per_program: int = PAIRS_PER_PROGRAM,
          one_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, k) pairs of ids [T, top_k] by expert, each expert's run padded to block_m.

    Returns sorted_ids [max_blocks * block_m] (pair index t * top_k + k, or T * top_k for padding; stable
    within an expert), block_expert [max_blocks] and num_padded [1], the rows in use. What lies at or
    past num_padded (rows of sorted_ids, their blocks in block_expert) is unspecified: nothing reads it.
    one_launch (default: up to ONE_LAUNCH_MAX_TOKENS tokens) has each program count all the pairs itself;
    else a launch of its own counts them, and a program takes more pairs when they would need more than
    MAX_ALIGN_PROGRAMS.
    """
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pow2 = triton.next_power_of_2(num_experts)
    if one_launch is None:
        one_launch = ids.shape[0] <= ONE_LAUNCH_MAX_TOKENS
    chunk = min(MAX_CHUNK, triton.next_power_of_2(pairs_per_program))
    if not one_launch:
        pairs_per_program = max(pairs_per_program, triton.cdiv(num_pairs, MAX_ALIGN_PROGRAMS))
    programs = max(1, triton.cdiv(num_pairs, pairs_per_program))  # one writes num_padded = 0 for no pairs
    counts = block_expert  # unread when one_launch
    if not one_launch:
        counts = torch.empty(programs, e_pow2, dtype=torch.int32, device=ids.device)
        _count_kernel[(programs,)](flat, counts, num_pairs, pairs_per_program, E_POW2=e_pow2, SCAN=HISTOGRAM_CHUNK)
    _place_kernel[(programs,)](flat, counts, sorted_ids, block_expert, num_padded, num_pairs, pairs_per_program,
                               programs, blocks, triton.cdiv(blocks, programs), BLOCK_M=block_m, E_POW2=e_pow2,
                               P_POW2=MAX_ALIGN_PROGRAMS, CHUNK=chunk, SCAN=HISTOGRAM_CHUNK, BLOCKS=BLOCK_TILE,
                               COUNTED=not one_launch)
    return sorted_ids, block_expert, num_padded


# Arguments that follow the step's token count are not specialized: a new value class would compile a variant in the
# middle of serving (tests/gpu/test_fp8_kernels_full_size.py)
@triton.jit(do_not_specialize=["num_pairs", "blocks_m", "stride_sag"])
def _expert_gemm_kernel(a_ptr, b_ptr, c_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                        num_pairs, rows_per_token, N, K, blocks_m,
                        stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        GATED: tl.constexpr, WEIGHTED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        s_ptr, stride_se, stride_sn, stride_sk, sa_ptr, stride_sag, SCALE_ROWS: tl.constexpr,
                        FP8: tl.constexpr, QUANTIZE_A: tl.constexpr, TILE_SCALE: tl.constexpr,
                        EMULATE: tl.constexpr):
    """C[pair, :N] = A[pair // rows_per_token] @ B[expert].T for one [BLOCK_M, BLOCK_N] tile of sorted pairs.

    GATED: B holds gate rows then up rows (N each) and C = silu(gate) * up. WEIGHTED: C is scaled by the
    pair's routing weight. Padding rows (index num_pairs) are neither read nor written. PRECISION is
    "ieee" for float32 inputs, as torch's own matmul (no TF32). FP8: B is e4m3 with scales at s_ptr
    [E, rows / SCALE_ROWS, K / BLOCK_K] and BLOCK_K is the scale group; A is e4m3 too (float32 holding e4m3
    values when EMULATE) with scales at sa_ptr [K / BLOCK_K, A's rows] (group-major, as
    `quantize_activation` writes them), or with QUANTIZE_A in x's dtype, each tile quantized per row here;
    TILE_SCALE: the tile's gate rows (and its up rows) lie in one weight block, so each group's weight scale
    is one number, folded into the rows' activation scales (one multiply-add per element, as in the FP8 GEMM).
    """
    # Consecutive programs share a group of GROUP_M row blocks so that their weight tiles stay in L2.
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * blocks_n
    first_m = pid // group_size * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tokens = rows // rows_per_token
    a_ptrs = a_ptr + tokens.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    # Columns past N wrap around instead of being masked: the loads stay in bounds, the store drops them.
    b_ptrs = b_ptr + expert * stride_be + (offs_n % N)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8 and TILE_SCALE:  # columns that wrap past N take a wrong scale here, but are not stored
        s_ptrs = s_ptr + expert * stride_se + pid_n * BLOCK_N // SCALE_ROWS * stride_sn
        s_up_ptrs = s_ptr + expert * stride_se + (pid_n * BLOCK_N + N) // SCALE_ROWS * stride_sn
    elif FP8:
        s_ptrs = s_ptr + expert * stride_se + (offs_n % N) // SCALE_ROWS * stride_sn
        s_up_ptrs = s_ptr + expert * stride_se + (offs_n % N + N) // SCALE_ROWS * stride_sn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None], other=0.0)
        if FP8 and QUANTIZE_A:
            a, sa = quantize_tile(a, 1, EMULATE)
        elif FP8:
            sa = tl.load(sa_ptr + k * stride_sag + tokens, mask=row_ok, other=0.0)
        if FP8 and TILE_SCALE:
            acc += dot_e4m3(a, b, EMULATE) * (sa * tl.load(s_ptrs + k * stride_sk))[:, None]
            if GATED:
                acc_up += dot_e4m3(a, b_up, EMULATE) * (sa * tl.load(s_up_ptrs + k * stride_sk))[:, None]
        elif FP8:
            acc += dot_e4m3(a, b, EMULATE) * sa[:, None] * tl.load(s_ptrs + k * stride_sk)[None, :]
            if GATED:
                acc_up += dot_e4m3(a, b_up, EMULATE) * sa[:, None] * tl.load(s_up_ptrs + k * stride_sk)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True, repr=False)
class MoEConfig:
    """Tiles of both expert GEMMs; block_m is also the padding of the align step (tl.dot needs >= 16).

    in_tile (FP8 experts): each program quantizes its activation tiles in registers instead of reading
    them quantized by a launch of their own. The work is redone by every column block, but the two
    launches are saved: the choice of the smallest batches, whose GEMMs read only a few experts."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    in_tile: bool = False

    def __repr__(self) -> str:
        """As the tables spell a row (in_tile only where set)."""
        tail = ", in_tile=True" if self.in_tile else ""
        return (f"MoEConfig(block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k}, "
                f"group_m={self.group_m}, num_warps={self.num_warps}, num_stages={self.num_stages}{tail})")


# Per (experts, I_local, hidden): rows of (up to this many tokens, config), ascending; the first row that
# covers T is used, the last one beyond. For qwen3-30b-a3b on an H200 at TP 1 (I_local 768) and TP 2 (384),
# in the format `benchmarks/moe.py --sweep` prints: its output replaces these rows.
CONFIGS: dict[tuple[int, int, int], tuple[tuple[int, MoEConfig], ...]] = {
    (128, 768, 2048): (
        (1, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
        (4, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (32, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
        (64, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (128, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (256, MoEConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (512, MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)),
        (1024, MoEConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)),
        (16384, MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
    ),
    (128, 384, 2048): (
        (1, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
        (2, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (4, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
        (8, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (64, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (128, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (256, MoEConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (512, MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)),
        (16384, MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
    ),
}


# FP8 experts (e4m3 weights, activations quantized per token and group): the same key and format, BLOCK_K the
# scale group (128). `benchmarks/moe.py --fp8 --sweep --write` rewrites these rows. I_local 768: swept on an
# H100 (2026-11-26; an H200 run may rewrite them): per MoE layer 0.58-0.69x bf16's time from 2 to 1,024 tokens,
# 0.80x at 4,096-16,384 (the table before it, one quantization per tile everywhere: no faster than bf16 in W1).
# I_local 384 (TP 2): CONFIGS' rows with BLOCK_K 128, quantizing in the tiles up to 32 tokens, until swept.
FP8_CONFIGS: dict[tuple[int, int, int], tuple[tuple[int, MoEConfig], ...]] = {
    (128, 768, 2048): (
        (1, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
        (2, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4, in_tile=True)),
        (8, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3, in_tile=True)),
        (32, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (64, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=3, in_tile=True)),
        (128, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (256, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (1024, MoEConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (16384, MoEConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)),
    ),
    (128, 384, 2048): (
        (1, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4, in_tile=True)),
        (2, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3, in_tile=True)),
        (4, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4, in_tile=True)),
        (8, MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=3, in_tile=True)),
        (64, MoEConfig(block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=3)),
        (128, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (256, MoEConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (512, MoEConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)),
        (16384, MoEConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)),
    ),
}


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """For shapes without a table: block_m follows the average rows per expert (decode wants it small)."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if rows <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    return MoEConfig(block_m=64 if rows <= 256 else 128, block_n=128, block_k=64, group_m=8, num_warps=8,
                     num_stages=3)


def pick_config(num_tokens: int, top_k: int, w13: torch.Tensor) -> MoEConfig:
    """The row for this shape and token count of the table for w13's dtype (FP8_CONFIGS for e4m3 experts),
    else the heuristic."""
    num_experts, two_inter, hidden = w13.shape
    table = FP8_CONFIGS if w13.dtype == torch.float8_e4m3fn else CONFIGS
    rows = table.get((num_experts, two_inter // 2, hidden))
    if rows is None:
        return default_config(num_tokens, top_k, num_experts)
    return next((config for max_tokens, config in rows if num_tokens <= max_tokens), rows[-1][1])


# Shared memory one block may use where the device does not say (the CPU, Triton's interpreter): the opt-in
# limit of the H100 and the H200, 227 KiB.
SMEM_LIMIT = 232448


def shared_memory(config: MoEConfig, x_size: int, w_size: int, gated: bool = True) -> int:
    """Bytes of shared memory the expert GEMM asks for, from the element sizes of x and of the weights
    (1: e4m3). Triton pipelines the loop's loads: A, the [BLOCK_M, BLOCK_K] tile of x, and B, the
    [BLOCK_K, BLOCK_N] weight tile (gate and up tiles when gated), are kept num_stages deep where both go
    straight to the tensor cores, as e4m3 A (x quantized before the GEMM) does; float32 (ieee, on the CUDA
    cores) keeps num_stages - 1 of both; FP8 in_tile keeps A in x's dtype num_stages - 1 deep and
    adds its e4m3 copy for the MMA. Exact for Triton 3.9 on sm_90 where the tiles go to wgmma (BLOCK_M >=
    64), an upper bound for the narrower mma.sync tiles (figures from `benchmarks/moe_smem.py`, in
    tests/kernels/test_moe_smem.py)."""
    a_size = 1 if w_size == 1 and not config.in_tile else x_size
    a = config.block_m * config.block_k * a_size
    b = config.block_k * config.block_n * w_size * (2 if gated else 1)
    stages = config.num_stages
    if w_size == 1 and config.in_tile:
        return (stages - 1) * a + stages * b + config.block_m * config.block_k
    if a_size == 4:
        return (stages - 1) * (a + b)
    return stages * (a + b)


@functools.cache
def shared_memory_limit(device: torch.device) -> int:
    """The most shared memory one block of `device` may opt in to (SMEM_LIMIT off CUDA)."""
    if device.type != "cuda":
        return SMEM_LIMIT
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", SMEM_LIMIT)


@functools.cache
def fit_shared_memory(config: MoEConfig, x_size: int, w_size: int, limit: int) -> MoEConfig:
    """config with fewer stages (down to 2), then (not FP8, whose BLOCK_K is the scale group) a shorter
    BLOCK_K, then a narrower BLOCK_N, until the gate/up GEMM (the larger of the two) fits `limit` bytes.

    The tables and the heuristic were tuned with 2-byte activations; float32 x doubles the A tile, and a
    config that does not fit fails at its launch (OutOfResources), e.g. FP8 experts of a float32 model
    took 245,760 bytes of an H200's 232,448 with 128 x 128 x 128 tiles in 3 stages, in_tile.
    Configs that fit are returned unchanged."""
    while shared_memory(config, x_size, w_size) > limit:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif w_size > 1 and config.block_k > 32:
            config = replace(config, block_k=config.block_k // 2)
        elif config.block_n > 16:
            config = replace(config, block_n=config.block_n // 2)
        else:
            raise ValueError(f"fused MoE: no tiles below {config} fit {limit} bytes of shared memory")
    return config


def launch_config(config: MoEConfig, x: torch.Tensor, w13: torch.Tensor, fp8: Fp8Config | None) -> MoEConfig:
    """The tiles both expert GEMMs launch with: FP8 steps through K one scale group at a time, and the
    tiles must fit the device's shared memory for these element sizes (`fit_shared_memory`)."""
    if fp8:
        config = replace(config, block_k=fp8.group)
    return fit_shared_memory(config, x.element_size(), w13.element_size(), shared_memory_limit(x.device))


def expert_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, aligned: tuple[torch.Tensor, ...],
                rows_per_token: int, config: MoEConfig, weights: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, fp8: Fp8Config | None = None,
                a_scale: torch.Tensor | None = None) -> None:
    """out[pair] = a[pair // rows_per_token] @ b[expert of pair].T over the aligned pairs; a gated b
    (2 * out columns rows) gives silu(gate) * up, weights [pairs] scale each pair's row. An e4m3 b comes
    with its `scale` [E, ...] and `fp8` settings, and a quantized with its `a_scale` [groups, rows]
    (`quantize_activation`) unless config.in_tile; config.block_k must be the scale group."""
    sorted_ids, block_expert, num_padded = aligned
    stride_sn, stride_sk = scale_strides(scale, fp8) if fp8 else (0, 0)
    n, k = out.shape[1], b.shape[2]
    gated = b.shape[1] == 2 * n
    tile_scale = fp8 is not None and fp8.block is not None and fp8.scale_rows % config.block_n == 0 and \
        n % fp8.scale_rows == 0
    blocks_m = block_expert.numel()
    grid = (blocks_m * triton.cdiv(n, config.block_n),)
    _expert_gemm_kernel[grid](
        a, b, out, sorted_ids, block_expert, num_padded, out if weights is None else weights,
        out.shape[0], rows_per_token, n, k, blocks_m, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        b.stride(2), out.stride(0), out.stride(1), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, GATED=gated, WEIGHTED=weights is not None,
        EVEN_K=k % config.block_k == 0, PRECISION="ieee" if a.dtype == torch.float32 else None,
        s_ptr=scale if fp8 else out, stride_se=scale.stride(0) if fp8 else 0, stride_sn=stride_sn,
        stride_sk=stride_sk, sa_ptr=out if a_scale is None else a_scale,
        stride_sag=0 if a_scale is None else a_scale.stride(0), SCALE_ROWS=fp8.scale_rows if fp8 else 1,
        FP8=fp8 is not None, QUANTIZE_A=fp8 is not None and config.in_tile, TILE_SCALE=tile_scale, EMULATE=EMULATE,
        num_warps=config.num_warps, num_stages=config.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  config: MoEConfig | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  fp8: Fp8Config | None = None) -> torch.Tensor:
    """Same result as `experts_torch`: x [T, H], w13 [E, 2 * I, H] (gate rows then up rows), w2 [E, H, I],
    weights/ids [T, top_k] -> [T, H]; e4m3 experts come with their (w13, w2) `scales` and `fp8` settings
    (then each GEMM's input is quantized once, by its own launch, unless config.in_tile). config
    overrides the table (tests, tuning); either is fitted to the shared memory (`launch_config`)."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    config = launch_config(config or pick_config(num_tokens, top_k, w13), x, w13, fp8)
    scales = scales or (None, None)
    aligned = align(ids, w13.shape[0], config.block_m)
    pairs = num_tokens * top_k

    def operand(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return quantize_activation(a, fp8.group) if fp8 and not config.in_tile else (a, None)

    act = torch.empty(pairs, w2.shape[2], dtype=x.dtype, device=x.device)
    a, a_scale = operand(x)
    expert_gemm(a, w13, act, aligned, top_k, config, scale=scales[0], fp8=fp8, a_scale=a_scale)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    a, a_scale = operand(act)
    expert_gemm(a, w2, out, aligned, 1, config, weights.reshape(-1), scale=scales[1], fp8=fp8, a_scale=a_scale)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
