"""How a Triton kernel writes a value into the KV pool as `KVPool.store` does (the rope kernel,
minisgl/kernels/rotary.py, stores the new tokens' K and V with it).

An fp8 pool gets each value rounded to the nearest float8_e4m3fn number (ties to even), saturated at +-448,
as `minisgl.kvcache.pool.to_cache_dtype` does in torch. The kernel rounds in fp32 arithmetic itself, so the
cast that follows is exact: the stored values equal torch's compiled or in Triton's interpreter, whose own
fp8 cast rounds ties away from zero, truncates subnormals and does not saturate. (Compiled for the GPU, a
negative value that rounds to zero is stored as +0 where torch writes -0: the same number.)
"""

from __future__ import annotations

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
def to_cache(x, dtype: tl.constexpr, FP8: tl.constexpr):
    """x as a pool of `dtype` stores it (FP8: that pool is float8_e4m3fn)."""
    if FP8:
        x = _round_to_e4m3(x.to(tl.float32))
    return x.to(dtype)
