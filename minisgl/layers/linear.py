"""Column- and row-parallel linear layers (Megatron style), used even at TP = 1.

Each parameter carries a `weight_loader(param, tensor, shard_id)` that copies this rank's slice of a
full checkpoint tensor into place; merged layers (QKV, gate/up) take one checkpoint tensor per shard_id.
All of them (and the LM head) multiply through `linear`, which sends decode-sized batches on a GPU to
the split-K GEMV kernel. With an `Fp8Config` a layer keeps e4m3 weights and their `weight_scale_inv`
(see `minisgl.layers.fp8`) and multiplies through `fp8_linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.kernels import TRITON_AVAILABLE, use_triton
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.fp8 import FP8_DTYPE, fp8_linear_torch, narrow_scale
from minisgl.quantization import Fp8Config

if TRITON_AVAILABLE:
    from minisgl.kernels.fp8 import fp8_gemm
    from minisgl.kernels.fp8_cublas import try_fp8_scaled_mm
    from minisgl.kernels.gemv import BLOCK_M, gemv, use_gemv
    from minisgl.kernels.native import try_fp8_gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           silu_mul: bool = False) -> torch.Tensor:
    """F.linear, or on a GPU the split-K GEMV kernel where it was measured faster: a few rows of x (a decode
    batch) and a weight shape with a row in its config table. Elsewhere F.linear, the kernel's reference.
    With `silu_mul`, x is a merged [gate | up] projection and silu_and_mul(x) is multiplied (inside the GEMV
    where it runs, saving the activation's launch)."""
    if use_triton(x) and x.dim() == 2 and x.dtype == weight.dtype and use_gemv(x.shape[0], *weight.shape):
        return gemv(x, weight, bias, silu_mul=silu_mul)
    return F.linear(silu_and_mul(x) if silu_mul else x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
               bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x W^T (+ b) for e4m3 W: on a GPU the split-K GEMV up to its 16 rows, else the FP8 GEMM; elsewhere
    their torch reference. On an H100 (benchmarks/fp8.py, tuned tables) qwen3-8b's four projections took
    3.2 ms per decode step in the GEMV at 16 rows and 4.5 ms in the GEMM. With `silu_mul`, x is a merged
    [gate | up] projection and silu_and_mul(x) is multiplied (inside the GEMV, or the GEMMs' activation
    quantization, on a GPU). Decode batches take csrc's CUDA GEMV first where `minisgl.kernels.native` chooses
    it and has it built; larger batches cuBLAS's block-scaled GEMM where `minisgl.kernels.fp8_cublas` chooses it
    and it serves (Hopper, 128 x 128 blocks, bf16/fp16), else the Triton GEMM."""
    if use_triton(x) and x.dim() == 2 and x.shape[0] <= BLOCK_M:
        out = try_fp8_gemv(x, weight, scale, config, bias, silu_mul)
        return out if out is not None else gemv(x, weight, bias, scale=scale, fp8=config, silu_mul=silu_mul)
    if use_triton(x) and x.dim() == 2:
        out = try_fp8_scaled_mm(x, weight, scale, config, bias, silu_mul)
        return out if out is not None else fp8_gemm(x, weight, scale, config, bias, silu_mul=silu_mul)
    return fp8_linear_torch(silu_and_mul(x) if silu_mul else x, weight, scale, config, bias)


def layer_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """x (silu_mul: silu_and_mul(x)) through a parallel layer's own weight, FP8 (with its scales) or not."""
    if layer.quant is None:
        return linear(x, layer.weight, bias, silu_mul)
    return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.quant, bias, silu_mul)


def fp8_weight(rows: int, cols: int, quant: Fp8Config | None) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A layer's weight [rows, cols] in the model dtype, or in e4m3 with its float32 `weight_scale_inv`."""
    if quant is None:
        return nn.Parameter(torch.empty(rows, cols), requires_grad=False), None
    return (nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False),
            nn.Parameter(torch.empty(quant.scale_shape(rows, cols), dtype=torch.float32), requires_grad=False))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b where W's output rows are split across ranks; each rank keeps its slice of y.

    `out_sizes` lists the full sizes of the checkpoint tensors merged into this one layer (one entry
    for a plain layer, [gate, up] for a merged MLP projection).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup, name: str = "linear",
                 quant: Fp8Config | None = None):
        super().__init__()
        self.tp, self.quant = tp, quant
        self.local_sizes = [tp.shard(size, f"{name} output size") for size in out_sizes]
        self.weight, self.weight_scale_inv = fp8_weight(sum(self.local_sizes), in_features, quant)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader, param.num_shards = self.load_shard, len(out_sizes)
        if quant is not None:
            self.weight_scale_inv.weight_loader = self.load_scale_shard
            self.weight_scale_inv.num_shards = len(out_sizes)

    def source_range(self, shard_id: int) -> tuple[int, int]:
        """(start, length) of this rank's rows inside checkpoint tensor `shard_id`."""
        length = self.local_sizes[shard_id]
        return self.tp.rank * length, length

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        start, length = self.source_range(shard_id)
        offset = sum(self.local_sizes[:shard_id])
        check_shape(param, loaded.narrow(0, start, length), param.data.narrow(0, offset, length))

    def load_scale_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        start, length = self.source_range(shard_id)
        unit = self.quant.scale_rows
        offset = sum(self.local_sizes[:shard_id])
        check_shape(param, narrow_scale(loaded, 0, start, length, unit),
                    narrow_scale(param.data, 0, offset, length, unit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_linear(self, x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection. Query heads are split across ranks; KV heads too when there are at
    least as many as ranks, otherwise each rank keeps a copy of the one KV head its query heads use."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup,
                 quant: Fp8Config | None = None):
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of num_key_value_heads "
                                 f"({num_kv_heads}), so KV heads cannot be replicated evenly")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.head_dim = head_dim
        q, kv = num_heads * head_dim, self.num_kv_heads * head_dim * tp.size
        super().__init__(hidden, [q, kv, kv], bias, tp, "qkv_proj", quant)

    def source_range(self, shard_id: int) -> tuple[int, int]:
        if shard_id == 0:
            return super().source_range(0)
        return self.kv_head_start * self.head_dim, self.num_kv_heads * self.head_dim


class RowParallelLinear(nn.Module):
    """y = x W^T + b where W's input columns are split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, name: str = "linear",
                 quant: Fp8Config | None = None):
        super().__init__()
        self.tp, self.quant = tp, quant
        self.local_in = tp.shard(in_features, f"{name} input size")
        self.weight, self.weight_scale_inv = fp8_weight(out_features, self.local_in, quant)
        self.weight.weight_loader = self.load_weight
        if quant is not None:
            self.weight_scale_inv.weight_loader = self.load_scale
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)  # whole, added once

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(param, loaded.narrow(1, self.tp.rank * self.local_in, self.local_in), param.data)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        unit = self.quant.group if self.quant.block else None
        check_shape(param, narrow_scale(loaded, 1, self.tp.rank * self.local_in, self.local_in, unit), param.data)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """With `silu_mul`, x is a merged [gate | up] projection and the layer multiplies silu(gate) * up."""
        y = self.tp.all_reduce(layer_linear(self, x, silu_mul=silu_mul))
        return y + self.bias if self.bias is not None else y


def check_shape(param: nn.Parameter, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy src into dst, or fail with both shapes (a mis-shaped checkpoint tensor must be named)."""
    if src.shape != dst.shape:
        raise ValueError(f"shape mismatch: checkpoint slice {tuple(src.shape)} vs parameter slice "
                         f"{tuple(dst.shape)} (parameter {tuple(param.shape)})")
    dst.copy_(src)
