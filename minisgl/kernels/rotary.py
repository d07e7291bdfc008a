"""Rotary embedding, optionally preceded by Qwen3's per-head q/k RMSNorm, for q and k in one kernel.

One program handles every q and k head of one token: it reads the token's position, loads that row
of the cos/sin tables once, and rotates all heads with it. The tables are `RotaryEmbedding`'s:
[max_positions, head_dim] float32 in the rotate-half layout, whose two halves are equal, so only the
first half is read. The norm follows `RMSNorm.norm` (float32, cast to the input dtype, times the
weight); the rotation runs in float32 and is rounded once, which is at least as exact as the torch
reference's rounding after every product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(src, head_stride, dst, n_heads, weight_ptr, eps, cos, sin,
                     HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate (and first normalise) the heads of one token: src [n_heads, 2 * HALF] -> dst, contiguous."""
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
    out_ty = dst.dtype.element_ty
    tl.store(dst + heads * (2 * HALF) + dims, (a * cos - b * sin).to(out_ty), mask=mask)
    tl.store(dst + heads * (2 * HALF) + HALF + dims, (b * cos + a * sin).to(out_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, q_token_stride, q_head_stride, k_ptr, k_token_stride, k_head_stride,
                         q_out_ptr, k_out_ptr, positions_ptr, positions_stride, cos_ptr, sin_ptr, table_stride,
                         q_weight_ptr, k_weight_ptr, eps, n_q_heads, n_k_heads,
                         HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token * positions_stride).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + position * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr + token * q_token_stride, q_head_stride, q_out_ptr + token * n_q_heads * 2 * HALF,
                     n_q_heads, q_weight_ptr, eps, cos, sin, HALF, BLOCK_Q, BLOCK_HALF, NORM)
    _norm_rope_heads(k_ptr + token * k_token_stride, k_head_stride, k_out_ptr + token * n_k_heads * 2 * HALF,
                     n_k_heads, k_weight_ptr, eps, cos, sin, HALF, BLOCK_K, BLOCK_HALF, NORM)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D] and k [T, kv_heads, D] (any strides with unit stride along D, e.g. views of a
    fused qkv output) -> new contiguous (q, k), rotated by the rows `positions` [T] of the cos/sin
    tables ([max_positions, D], equal strides); with q_weight/k_weight [D] (both or neither), each
    head is RMS-normalised first."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together")
    tokens, n_q, dim = q.shape
    n_k = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    norm = q_weight is not None
    block_q, block_half = triton.next_power_of_2(n_q), triton.next_power_of_2(dim // 2)
    _qk_norm_rope_kernel[(tokens,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), q_out, k_out, positions, positions.stride(0),
        cos, sin, cos.stride(0), q_weight if norm else q, k_weight if norm else k, eps, n_q, n_k,
        HALF=dim // 2, BLOCK_Q=block_q, BLOCK_K=triton.next_power_of_2(n_k), BLOCK_HALF=block_half, NORM=norm,
        num_warps=4 if block_q * block_half <= 2048 else 8)
    return q_out, k_out
