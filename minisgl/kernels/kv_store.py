"""Write the new tokens' K and V into the paged pool in one launch (`KVPool.store` is the reference:
two `index_copy_` calls, i.e. two launches per layer, which shows at small batches).

An fp8 pool gets each value rounded to the nearest float8_e4m3fn number (ties to even), saturated at +-448,
as `minisgl.kvcache.pool.to_cache_dtype` does in torch. The kernel rounds in fp32 arithmetic itself, so the
cast that follows is exact: the stored values equal torch's compiled or in Triton's interpreter, whose own
fp8 cast rounds ties away from zero, truncates subnormals and does not saturate. (Compiled for the GPU, a
negative value that rounds to zero is stored as +0 where torch writes -0: the same number.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kvcache.pool import FP8_E4M3_MAX

# Globals a kernel reads must be constexpr for the compiler (the interpreter does not check).
SATURATION = tl.constexpr(FP8_E4M3_MAX)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding it leaves no fraction bits, so fp32 addition rounds to integers


@triton.jit
def _round_to_e4m3(x):
    """x (fp32) as the nearest float8_e4m3fn value, still in fp32; the sign bit is kept (-0.0 included)."""
    magnitude = tl.minimum(tl.abs(x), SATURATION)
    # e4m3 keeps 3 mantissa bits and its smallest normal exponent is -6 (below: subnormals, steps of 2**-9),
    # so its step at `magnitude` is 2**(exponent - 3); scaling by powers of two is exact.
    exponent = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, 127 - 6)  # biased by 127
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((254 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    rounded = ((magnitude * inverse_step + MAGIC) - MAGIC) * step
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def _to_cache(x, dtype: tl.constexpr, FP8: tl.constexpr):
    if FP8:
        x = _round_to_e4m3(x.to(tl.float32))
    return x.to(dtype)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_slot, stride_head, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    """Program t: token t's [HEADS, HEAD_DIM] of K and of V go to pool slot slots[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < HEADS) & (dims < HEAD_DIM)
    dst = slot * stride_slot + heads * stride_head + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr.dtype.element_ty, FP8), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr.dtype.element_ty, FP8), mask=mask)


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
                                BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
                                FP8=k_cache.dtype == torch.float8_e4m3fn)
