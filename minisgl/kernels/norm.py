"""RMSNorm, and residual-add + RMSNorm, as one kernel each (one program per row).

Numerics follow `minisgl.layers.norm.RMSNorm.norm` (the reference): the residual add happens in the
input dtype, the mean square and the scaling in float32, the result is cast to the input dtype and only
then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import use_pdl


@triton.jit
def _rms_norm_kernel(x_ptr, x_row_stride, res_ptr, res_row_stride, out_ptr, res_out_ptr, weight_ptr, n, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel, if launched as a programmatic dependent (the decode GEMV), may launch now
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        x = x + tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (x32 * scale).to(x.dtype) * weight
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with unit stride along n: a view for the usual layouts, a copy otherwise."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2.stride(0), res2, res2.stride(0), out, res_out, weight, n, eps,
                                         ADD_RESIDUAL=residual is not None, BLOCK=block, PDL=use_pdl(x.device),
                                         num_warps=min(max(block // 256, 1), 16))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); a new contiguous tensor."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors; the inputs are left untouched."""
    return _launch(x, residual, weight, eps)
