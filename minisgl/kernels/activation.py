"""SiLU-and-mul (SwiGLU) on a merged [gate | up] projection, in one kernel.

Numerics follow `minisgl.layers.activation.silu_and_mul`: silu in float32, rounded to the input dtype,
then multiplied by `up` in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up for tiles in the input dtype: silu in float32, rounded to up's dtype, times up. Every
    kernel that forms the MLP's activation (this one, the decode GEMV's, the FP8 quantization's) calls it, so
    that they give the same values bit for bit."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_row_stride, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_row_stride + n + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:] as a new contiguous [..., I] tensor."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, BLOCK))](x2, x2.stride(0), out, n, BLOCK=BLOCK)
    return out
