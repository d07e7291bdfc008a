"""Rotary embedding, optionally preceded by Qwen3's per-head q/k RMSNorm, with the new K/V written to the KV pool.

One program handles one token: it reads the token's position, loads that row of the cos/sin tables once,
rotates all its q heads into a new q tensor and all its k heads straight into the pool at the token's slot,
and copies its v heads there too. Why the store is here: the kernel already holds each token's roped k, and a
separate store kernel would be one more launch per layer, which a batch-1 decode step (one CUDA graph of a few
hundred tiny kernels) pays in full: ~3-4 us a layer on an H200.

The tables are `RotaryEmbedding`'s: [max_positions, head_dim] float32 in the rotate-half layout, whose two
halves are equal, so only the first half is read. The norm follows `RMSNorm.norm` (float32, cast to the input
dtype, times the weight); the rotation runs in float32 and is rounded once to the model's dtype, which is at
least as exact as the torch reference's rounding after every product. K and V then go to the pool as
`KVPool.store` writes them: an fp8 pool gets them through `kv_store.to_cache` (round to nearest even,
saturating).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.kv_store import to_cache


@triton.jit
def _norm_rope_heads(src, head_stride, dst, n_heads, weight_ptr, eps, cos, sin, HALF: tl.constexpr,
                     BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr):
    """Rotate (and first normalise) the heads of one token: src [n_heads, 2 * HALF] -> dst, contiguous; the
    result is rounded to src's dtype, then stored as dst's (FP8: dst is an fp8 pool)."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    first = tl.load(src + heads * head_stride + dims, mask=mask, other=0.0)
    second = tl.load(src + heads * head_stride + HALF + dims, mask=mask, other=0.0)
    if NORM:
        a, b = first.to(tl.float32), second.to(tl.float32)
        scale = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        first = (a * scale).to(first.dtype) * tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0)
        second = (b * scale).to(second.dtype) * tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0)
    a, b = first.to(tl.float32), second.to(tl.float32)
    in_ty = src.dtype.element_ty  # two statements: Triton 3.6 cannot unpack a tuple of dtypes
    out_ty = dst.dtype.element_ty
    tl.store(dst + heads * (2 * HALF) + dims, to_cache((a * cos - b * sin).to(in_ty), out_ty, FP8), mask=mask)
    tl.store(dst + heads * (2 * HALF) + HALF + dims, to_cache((b * cos + a * sin).to(in_ty), out_ty, FP8),
             mask=mask)


@triton.jit
def _rope_store_kernel(q_ptr, q_token_stride, q_head_stride, k_ptr, k_token_stride, k_head_stride,
                       v_ptr, v_token_stride, v_head_stride, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                       positions_ptr, positions_stride, cos_ptr, sin_ptr, table_stride,
                       q_weight_ptr, k_weight_ptr, eps, n_q_heads, n_k_heads,
                       HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token * positions_stride).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + position * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr + token * q_token_stride, q_head_stride, q_out_ptr + token * n_q_heads * 2 * HALF,
                     n_q_heads, q_weight_ptr, eps, cos, sin, HALF, BLOCK_Q, BLOCK_HALF, NORM, False)
    cache_offset = slot * n_k_heads * 2 * HALF  # the pool's [slots, kv_heads, 2 * HALF] is contiguous
    _norm_rope_heads(k_ptr + token * k_token_stride, k_head_stride, k_cache_ptr + cache_offset,
                     n_k_heads, k_weight_ptr, eps, cos, sin, HALF, BLOCK_K, BLOCK_HALF, NORM, FP8)
    heads = tl.arange(0, BLOCK_K)[:, None]
    full = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    mask = (heads < n_k_heads) & (full < 2 * HALF)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + full, mask=mask)
    tl.store(v_cache_ptr + cache_offset + heads * (2 * HALF) + full, to_cache(v, v_cache_ptr.dtype.element_ty, FP8),
             mask=mask)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """q [T, heads, D], k and v [T, kv_heads, D] (any strides with unit stride along D, e.g. views of a fused
    qkv output) -> the new contiguous q, rotated by the rows `positions` [T] of the cos/sin tables
    ([max_positions, D], equal strides); the rotated k and v go to k_cache/v_cache (one layer of the pool,
    [pool slots, kv_heads, D], contiguous) at `slots` [T]. With q_weight/k_weight [D] (both or neither), each q
    and k head is RMS-normalised first."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together")
    tokens, n_q, dim = q.shape
    n_k = k.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[1:] == (n_k, dim) and k_cache.dtype == v_cache.dtype and slots.stride(0) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    norm = q_weight is not None
    block_q, block_half = triton.next_power_of_2(n_q), triton.next_power_of_2(dim // 2)
    _rope_store_kernel[(tokens,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), q_out,
        k_cache, v_cache, slots, positions, positions.stride(0), cos, sin, cos.stride(0),
        q_weight if norm else q, k_weight if norm else k, eps, n_q, n_k,
        HALF=dim // 2, BLOCK_Q=block_q, BLOCK_K=triton.next_power_of_2(n_k), BLOCK_HALF=block_half, NORM=norm,
        FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4 if block_q * block_half <= 2048 else 8)
    return q_out
