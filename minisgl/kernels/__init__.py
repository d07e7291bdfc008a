"""Triton kernels for the GPU fast path. Each has a torch reference elsewhere in the package (its
oracle and CPU fallback); tests run them on the CPU under TRITON_INTERPRET=1 at small shapes."""

from importlib.util import find_spec

import torch

TRITON_AVAILABLE = find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer should run its fused kernel on `x`: on a GPU with Triton installed. Everywhere
    else (the CPU, or no Triton) the layer's torch code runs, which is also the kernels' oracle."""
    return TRITON_AVAILABLE and x.is_cuda
