"""Activations."""

import torch
import torch.nn.functional as F

from minisgl.kernels import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    from minisgl.kernels import activation as kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [gate | up] projection: one Triton kernel on a GPU, `silu_and_mul_torch` (the
    kernel's reference) elsewhere."""
    return kernels.silu_and_mul(x) if use_triton(x) else silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
