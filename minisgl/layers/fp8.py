"""FP8 (e4m3) weights: quantization and the torch reference of an FP8 linear layer (their configuration,
`Fp8Config`, is in `minisgl.quantization`).

Two layouts of weight scales, both stored as `weight_scale_inv` (the factor that dequantizes) in float32:
- block-scaled, as the Hugging Face FP8 checkpoints (Qwen/Qwen3-8B-FP8): one scale per [128, 128] block
  of W [N, K], shape [ceil(N / 128), ceil(K / 128)];
- per-channel, what `--quantization fp8` makes of a bf16 checkpoint at load: one scale per output row, [N, 1].

Activations are quantized dynamically, per token and per group of GROUP (the block's width) input
columns: y[m, n] = sum over groups g of sx[m, g] * sw[n, g] * (xq[m, g] . wq[n, g]), with xq and wq in
e4m3 and the dot products exact in float32. The checkpoints' own scheme for block-scaled weights; for
per-channel weights it is finer than vLLM's one scale per token, at the same cost in our kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minisgl.quantization import Fp8Config

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-10  # an all-zero group still gets a finite scale


def expand_scale(scale: torch.Tensor, rows: int, cols: int, config: Fp8Config) -> torch.Tensor:
    """Each weight's own scale: [..., rows, cols] from a block or per-channel scale tensor."""
    per_col = config.group if config.block else cols
    full = scale.repeat_interleave(config.scale_rows, dim=-2).repeat_interleave(per_col, dim=-1)
    return full[..., :rows, :cols]


def quantize_weight(w: torch.Tensor, config: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] -> (e4m3 W / scale, float32 scale [..., scale rows, scale columns]) with each block's (or
    row's) largest magnitude at FP8_MAX; leading dims (experts) are quantized each on its own."""
    *lead, n, k = w.shape
    rows, cols = config.scale_shape(n, k)
    w32 = w.float()
    if config.block:
        pad = F.pad(w32.abs(), (0, cols * config.group - k, 0, rows * config.scale_rows - n))
        amax = pad.view(*lead, rows, config.scale_rows, cols, config.group).amax(dim=(-3, -1))
    else:
        amax = w32.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=MIN_SCALE) / FP8_MAX
    q = (w32 / expand_scale(scale, n, k, config)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, config: Fp8Config) -> torch.Tensor:
    """float32 W from its e4m3 values and scales (any leading dims, e.g. experts)."""
    return q.float() * expand_scale(scale, q.shape[-2], q.shape[-1], config)


def quantize_activation(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 x / scale, float32 scales [M, ceil(K / group)]): one scale per token and group."""
    m, k = x.shape
    groups = math.ceil(k / group)
    x32 = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = x32.abs().amax(dim=2).clamp(min=MIN_SCALE) / FP8_MAX
    q = (x32 / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k], scale


def fp8_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of every FP8 GEMM and GEMV kernel: x quantized per token and group, both operands
    dequantized to float32, one matmul; output in x's dtype."""
    xq, sx = quantize_activation(x, config.group)
    x_dq = xq.float() * sx.repeat_interleave(config.group, dim=1)[:, : x.shape[1]]
    y = F.linear(x_dq, dequantize_weight(w, scale, config), bias.float() if bias is not None else None)
    return y.to(x.dtype)


def narrow_scale(scale: torch.Tensor, dim: int, start: int, length: int, unit: int | None) -> torch.Tensor:
    """The scales of weight rows (or columns) [start, start + length) along `dim`, `unit` weights per
    scale (None: one scale for the whole dimension). A slice must begin on a block boundary."""
    if unit is None:
        return scale
    if start % unit:
        raise ValueError(f"a tensor-parallel or merged slice starting at {start} is not aligned to the FP8 "
                         f"weight blocks of {unit}")
    return scale.narrow(dim, start // unit, math.ceil(length / unit))
