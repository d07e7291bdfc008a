"""RMSNorm, with the residual add fused in as every decoder layer uses it."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    from minisgl.kernels.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in float32 and scale in the input dtype, exactly as the HF reference does."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). On a GPU, one Triton
        kernel does either; elsewhere `forward_torch`, which is also the kernels' reference."""
        if not use_triton(x):
            return self.forward_torch(x, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x
