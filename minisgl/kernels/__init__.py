"""Triton kernels for the GPU fast path. Each has a torch reference elsewhere in the package (its
oracle and CPU fallback); tests run them on the CPU under TRITON_INTERPRET=1 at small shapes."""

import os
from importlib.util import find_spec

import torch

TRITON_AVAILABLE = find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer should run its fused kernel on `x`: on a GPU with Triton installed. Everywhere
    else (the CPU, or no Triton) the layer's torch code runs, which is also the kernels' oracle."""
    return TRITON_AVAILABLE and x.is_cuda


_pdl: dict[torch.device, bool] = {}


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (Hopper or newer, unless MINISGL_PDL=0):
    the decode GEMV is launched early and reads its first weight tile while the kernel before it finishes,
    waiting (griddepcontrol.wait) only before it reads x; the kernels before it (RMSNorm, the GEMV itself)
    let it launch as soon as they start (griddepcontrol.launch_dependents, a no-op for other successors)."""
    if device not in _pdl:
        _pdl[device] = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
                        and os.environ.get("MINISGL_PDL", "1") != "0")
    return _pdl[device]
