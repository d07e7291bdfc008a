"""Write the new tokens' K and V into the paged pool in one launch (`KVPool.store` is the reference:
two `index_copy_` calls, i.e. two launches per layer, which shows at small batches)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_slot, stride_head, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Program t: token t's [HEADS, HEAD_DIM] of K and of V go to pool slot slots[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < HEADS) & (dims < HEAD_DIM)
    dst = slot * stride_slot + heads * stride_head + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache/v_cache [slots, kv_heads, D] (one layer of the pool, same layout), slots [T],
    k/v [T, kv_heads, D] with unit stride along D (views of the QKV output are fine)."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                k_cache.stride(0), k_cache.stride(1), HEADS=heads, HEAD_DIM=head_dim,
                                BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim))
