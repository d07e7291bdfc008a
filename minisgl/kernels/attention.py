"""Paged attention in Triton: split-K decode (flash-decoding) and tiled extend/prefill.

Both kernels read keys and values straight from the KV pool through the page table
(slot = page_table[row, pos // page_size] * page_size + pos % page_size), so the cached prefix and
the tokens stored this step are one loop. Query heads that share a KV head are packed into the rows
of one tile: K/V are loaded once per KV head, and `tl.dot` gets at least 16 rows even in decode.
Scores use exp2 with the scale folded in; accumulation is fp32, output in q's dtype. The pool may hold K/V
in a narrower type than q (fp8): a tile is loaded as stored and upcast in registers, so an fp8 pool halves
the bytes read with the same kernels. Over fp8 a 16-bit model computes the dots in fp16 (COMPUTE): e4m3
widens to fp16 in one instruction (bf16 takes a detour through fp32), every e4m3 value is exact in fp16, and
q's range (|q| far below 65504) loses nothing that matters.
The per-request metadata (rows, lengths) are views into one packed tensor whose alignment follows the
batch size: they are not specialized, so no batch compiles a new variant after the warm-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from minisgl.kernels import use_pdl
from minisgl.kernels.arrival import last_to_arrive

LOG2E = 1.4426950408889634
EXTEND_BLOCK_R = 64  # tile_ends entries an extend program scans per load (any count works; fewer take one load)


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch knobs; the defaults aim at Hopper (H100/H200) with bf16 and head_dim 128."""

    decode_block_n: int = 64  # keys per loop step of a decode split
    decode_warps: int = 4
    decode_stages: int = 2
    decode_splits: int | None = None  # fixed number of KV splits; None: chosen from batch size and SM count
    max_splits: int = 32  # cap of the automatic choice (and size of the partial-result scratch)
    programs_per_sm: int = 2  # the automatic choice aims at this many decode programs per SM
    # Extend tiles from `benchmarks/attention.py --extend-sweep` on an H100 (prompts of 512-1,600 tokens, fresh or
    # after a prefix, 16/8, 32/8 and 32/4 heads): 64 rows, 64 keys, 4 warps, 3 stages took 0.74x the time of
    # 128 / 64 / 8 / 2 (qwen3-8b, 12 prompts of 640 tokens: 198 against 248 us a layer).
    extend_block_m: int = 64  # query rows (tokens x heads of one KV group) per extend tile
    extend_block_n: int = 64
    extend_warps: int = 4
    extend_stages: int = 3

    def fitted(self, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> KernelConfig:
        """The tiles for this compute dtype (the model's) and pool dtype. Extend: fp32 takes twice the registers
        and shared memory (halve both sides), and head_dim 256 spills registers at 128 query rows on Hopper
        (halve the rows). Decode over a 1-byte pool: twice the keys per step and three stages keep as many
        bytes in flight as 16 bits do (H200, batch 256 x 4096 keys: 766 us against 1,296 us at 64 keys and two
        stages; bf16 takes 1,107 us)."""
        block_m, block_n = self.extend_block_m, self.extend_block_n
        if dtype.itemsize >= 4:
            block_m, block_n = block_m // 2, block_n // 2
        if head_dim > 128:
            block_m //= 2
        decode_block_n, decode_stages = self.decode_block_n, self.decode_stages
        if kv_dtype.itemsize == 1:
            decode_block_n, decode_stages = 2 * decode_block_n, max(3, decode_stages)
        return replace(self, extend_block_m=max(16, block_m), extend_block_n=max(16, block_n),
                       decode_block_n=decode_block_n, decode_stages=decode_stages)


def num_decode_splits(batch: int, kv_heads: int, num_sms: int, config: KernelConfig) -> int:
    """Splits per (request, KV head) for decode. Independent of sequence lengths, so a CUDA graph
    captured for one batch size replays correctly for any lengths: enough programs to fill the GPU."""
    if config.decode_splits is not None:
        return config.decode_splits
    wanted = triton.cdiv(config.programs_per_sm * num_sms, batch * kv_heads)
    return max(1, min(config.max_splits, wanted))


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, page_row_ptr, offs_n, mask_n, head_offset, stride_slot, offs_d, mask_d,
                  PAGE_SIZE: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of context positions offs_n, gathered through one page-table row, as stored
    (the online-softmax step upcasts them to q's dtype)."""
    pages = tl.load(page_row_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    slots = pages.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    offsets = slots[:, None] * stride_slot + head_offset + offs_d[None, :]
    mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, visible, MASKED: tl.constexpr):
    """One key block of flash attention in the log2 domain. m_i starts finite (-1e30), so rows that
    see no key in a block keep alpha = 1 and p = 0 instead of producing NaN."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _split_chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split, a whole number of blocks: short sequences leave the last splits empty."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["rows_ptr", "seq_lens_ptr"])
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, page_table_ptr, rows_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
                         part_lse_ptr, counter_ptr, stride_qt, stride_qh, stride_slot, stride_kh, stride_pt,
                         stride_ot, stride_oh, qk_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr, PDL: tl.constexpr):
    """Program (request, KV head, split): the GROUP query heads of one KV head over one key range.
    Without SPLIT (one split) the result is final; else the normalised partial output and its log2-sum-exp
    go to scratch [B, heads, splits, (D)], and the last of the (request, KV head)'s non-empty splits to arrive
    (counter_ptr [B, kv_heads], zeros, which it resets) weighs them into the output: no second launch, which a
    batch-1 decode step would pay in every layer. The split count is the grid's third size, not a compile-time
    constant: a mixed step's decode rows come in any number, and each count compiled as its own variant
    stalled the first step that met it (see `decode_attention`)."""
    if PDL:  # the o projection's GEMV (a programmatic dependent) may launch now; it waits for this grid to end
        tl.extra.cuda.gdc_launch_dependents()
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_splits = tl.num_programs(2)
    chunk = _split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start >= end:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(COMPUTE)
    page_row_ptr = page_table_ptr + tl.load(rows_ptr + req).to(tl.int64) * stride_pt

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v = _load_kv_tile(k_ptr, v_ptr, page_row_ptr, offs_n, mask_n, kv_head * stride_kh, stride_slot,
                             offs_d, mask_d, PAGE_SIZE)
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, mask_n[None, :], True)

    acc = acc / l_i[:, None]
    mask = mask_h[:, None] & mask_d[None, :]
    out_ptrs = out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = (req * tl.num_programs(1) * GROUP + heads) * num_splits  # [BLOCK_H]: split 0 of each head
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=mask_h)
        tl.store(part_out_ptr + (base + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        counter = counter_ptr + req * tl.num_programs(1) + kv_head
        used = tl.cdiv(seq_len, chunk)
        if last_to_arrive(counter, used):
            _reduce_splits(part_out_ptr, part_lse_ptr, base, used, out_ptrs, mask, mask_h, offs_d, HEAD_DIM,
                           BLOCK_H, BLOCK_S, BLOCK_D)
            tl.store(counter, 0)


@triton.jit
def _reduce_splits(part_out_ptr, part_lse_ptr, base, used, out_ptrs, mask, mask_h, offs_d, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Weigh the `used` splits' partial outputs of the heads at `base` by their shares of the softmax mass.
    The loads bypass L1 (.cg): the other splits' programs wrote them, on other SMs."""
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base[:, None] + offs_s[None, :], mask=mask_h[:, None] & (offs_s[None, :] < used),
                  other=float("-inf"), cache_modifier=".cg")
    lse = tl.where(mask_h[:, None], lse, 0.0)  # padding heads: no -inf rows (NaN); their output is masked
    weights = tl.exp2(lse - tl.max(lse, 1)[:, None])
    weights = weights / tl.sum(weights, 1)[:, None]
    out = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        part = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
        out += part * tl.sum(tl.where(offs_s[None, :] == s, weights, 0.0), 1)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows_ptr", "kv_lens_ptr", "extend_lens_ptr", "q_starts_ptr", "tile_ends_ptr",
                              "num_reqs"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, page_table_ptr, rows_ptr, kv_lens_ptr, extend_lens_ptr, q_starts_ptr,
                   tile_ends_ptr, num_reqs, out_ptr, stride_qt, stride_qh, stride_slot, stride_kh, stride_pt, stride_ot,
                   stride_oh, qk_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr):
    """Program (tile, KV head): TOKENS new tokens x GROUP query heads (row r is token r // GROUP, head r % GROUP)
    of one request against its keys [0, kv_len + last token]. Keys below the tile's first query position are
    visible to every row (no mask); the diagonal blocks after them get the causal mask.

    The tiles form one list over the requests: tile_ends [num_reqs] holds the running total of each request's
    tiles (cdiv(extend_len, TOKENS)), and program p serves the request whose range holds p (counted over
    BLOCK_R entries at a time: one load for up to BLOCK_R requests). Programs past the last tile exit at once,
    as do requests of extend_len 0 (they own no tile). So the grid depends only on an upper bound of the tiles,
    and a CUDA graph captured at a token bucket replays any step that fits it (engine/whole_graph.py). Within a
    request its last tile (the most keys to read) comes first."""
    p, kv_head = tl.program_id(0), tl.program_id(1)
    if p >= tl.load(tile_ends_ptr + num_reqs - 1):
        return
    req = 0
    for r0 in range(0, num_reqs, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        ends = tl.load(tile_ends_ptr + offs_r, mask=offs_r < num_reqs, other=2**31 - 1)
        req += tl.sum((ends <= p).to(tl.int32), 0)
    tile = tl.load(tile_ends_ptr + req) - 1 - p  # from the request's last tile back to its first
    extend_len = tl.load(extend_lens_ptr + req)
    first = tile * TOKENS
    kv_len = tl.load(kv_lens_ptr + req)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tokens = first + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    mask_m = (offs_m < TOKENS * GROUP) & (tokens < extend_len)
    mask_d = offs_d < HEAD_DIM
    mask = mask_m[:, None] & mask_d[None, :]
    q_tokens = tl.load(q_starts_ptr + req) + tokens
    q = tl.load(q_ptr + q_tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0).to(COMPUTE)
    page_row_ptr = page_table_ptr + tl.load(rows_ptr + req).to(tl.int64) * stride_pt
    head_offset = kv_head * stride_kh

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    shared_end = (kv_len + first) // BLOCK_N * BLOCK_N
    for n0 in range(0, shared_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(k_ptr, v_ptr, page_row_ptr, offs_n, offs_n < shared_end, head_offset, stride_slot,
                             offs_d, mask_d, PAGE_SIZE)
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, None, False)
    query_pos = kv_len + tokens
    causal_end = kv_len + tl.minimum(first + TOKENS, extend_len)
    for n0 in range(shared_end, causal_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(k_ptr, v_ptr, page_row_ptr, offs_n, offs_n < causal_end, head_offset, stride_slot,
                             offs_d, mask_d, PAGE_SIZE)
        visible = offs_n[None, :] <= query_pos[:, None]
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, visible, True)

    acc = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # l_i is 0 only on padding rows
    tl.store(out_ptr + q_tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _qk_scale(head_dim: int) -> float:
    return LOG2E / math.sqrt(head_dim)


def _compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> tl.dtype:
    """The dtype of the dots: q's, except fp16 for a 16-bit q over an fp8 pool (see the module docstring)."""
    if k_cache.dtype == torch.float8_e4m3fn and q.dtype.itemsize == 2:
        return tl.float16
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, part_out: torch.Tensor | None,
                     part_lse: torch.Tensor | None, counter: torch.Tensor | None, page_size: int, num_splits: int,
                     config: KernelConfig) -> None:
    """One query token per request: q [B, heads, D] over k/v_cache [slots, kv_heads, D] -> out [B, heads, D], B the
    requests in `rows` (q and out may hold more rows, left alone: a mixed step's chunks follow its decodes; a
    request of seq_len 0, a CUDA graph's padding, leaves its row of out alone too).
    With num_splits > 1, part_out [B, heads, num_splits, D] and part_lse [B, heads, num_splits] (fp32), and
    counter [B, kv_heads] (int32 zeros; left zeros, so every layer of a step can share it). Any split count
    runs the same two compiled variants (one split or several; the reduce's lanes cover max_splits): the decode
    graphs compile them, and no batch size met later compiles another."""
    batch, (heads, head_dim) = rows.numel(), q.shape[1:]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, rows, seq_lens, out, part_out, part_lse, counter,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1), _qk_scale(head_dim),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, SPLIT=num_splits > 1,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=config.decode_block_n,
        BLOCK_S=triton.next_power_of_2(max(num_splits, config.max_splits)), BLOCK_D=_block_d(head_dim),
        COMPUTE=_compute_dtype(q, k_cache), PDL=use_pdl(q.device), num_warps=config.decode_warps,
        num_stages=config.decode_stages)


def _extend_block_m(group: int, config: KernelConfig) -> int:
    """Query rows per extend tile: the config's, or a power of two that holds one token's `group` heads."""
    return max(config.extend_block_m, triton.next_power_of_2(group))


def extend_tokens_per_tile(heads: int, kv_heads: int, config: KernelConfig) -> int:
    """New tokens per extend tile: its query rows hold `group` heads of each token."""
    group = heads // kv_heads
    return _extend_block_m(group, config) // group


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     rows: torch.Tensor, kv_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor,
                     tile_ends: torch.Tensor, tiles: int, out: torch.Tensor, page_size: int,
                     config: KernelConfig) -> None:
    """Ragged new tokens: q [T, heads, D] (request i's tokens are rows q_starts[i] ..) attend causally to their
    request's keys [0, kv_len + own index] in the pool, whose new K/V must already be stored -> out. tile_ends:
    the running total of each request's tiles of extend_tokens_per_tile tokens; `tiles`: the grid, at least
    their total (extra programs exit). Rows of `out` that no request owns are left as they were."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    block_m = _extend_block_m(group, config)
    num_reqs = rows.numel()
    if num_reqs == 0 or tiles == 0:
        return
    _extend_kernel[(tiles, kv_heads)](
        q, k_cache, v_cache, page_table, rows, kv_lens, extend_lens, q_starts, tile_ends, num_reqs, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1), _qk_scale(head_dim),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, TOKENS=block_m // group,
        BLOCK_M=block_m, BLOCK_N=config.extend_block_n, BLOCK_R=EXTEND_BLOCK_R, BLOCK_D=_block_d(head_dim),
        COMPUTE=_compute_dtype(q, k_cache), num_warps=config.extend_warps, num_stages=config.extend_stages)
