"""Sparse mixture-of-experts: top-k routing and the expert computation.

Experts are tensor-parallel along their intermediate dimension: every rank holds a slice of every
expert, and the partial outputs are all-reduced, exactly as a row-parallel MLP. On CUDA the experts run
in the fused Triton kernel (`minisgl.kernels.fused_moe`), or for a few tokens (decode) in two GEMV launches
without its align step (`minisgl.kernels.moe_gemv`); `experts_torch` is their reference and the path
everywhere else. FP8 experts (an `Fp8Config`) keep e4m3 weights with `w13_scale_inv`/`w2_scale_inv`,
laid out as a linear layer's `weight_scale_inv` with a leading expert dimension.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.fp8 import FP8_DTYPE, fp8_linear_torch, narrow_scale
from minisgl.layers.linear import check_shape
from minisgl.quantization import Fp8Config

try:
    from minisgl.kernels.fused_moe import fused_experts, route_fused
    from minisgl.kernels.moe_gemv import moe_gemv, use_moe_gemv
except ImportError:  # no Triton: the torch path everywhere
    fused_experts = route_fused = moe_gemv = use_moe_gemv = None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, keep the top k; optionally renormalise them to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def pick_experts(num_tokens: int, on_gpu: bool) -> Callable[..., torch.Tensor]:
    """The expert computation for a batch of num_tokens: `experts_torch` off the GPU (or without Triton),
    else the few-token GEMVs up to `SMALL_MOE_MAX_TOKENS`, else the fused MoE. All take the same arguments."""
    if not on_gpu or fused_experts is None:
        return experts_torch
    return moe_gemv if use_moe_gemv(num_tokens) else fused_experts


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  fp8: Fp8Config | None = None) -> torch.Tensor:
    """Reference: each expert runs on the tokens routed to it; outputs are summed, weighted.

    w13: [E, 2 * I, H] (gate rows then up rows), w2: [E, H, I], weights/ids: [T, top_k]; FP8 experts
    come with `fp8` and their (w13, w2) scales.
    """
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)

    def expert_linear(a: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        w = (w13, w2)[which][expert]
        return F.linear(a, w) if fp8 is None else fp8_linear_torch(a, w, scales[which][expert], fp8)

    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        h = expert_linear(silu_and_mul(expert_linear(x[token], expert, 0)), expert, 1)
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 tp: TPGroup, quant: Fp8Config | None = None):
        super().__init__()
        self.tp, self.top_k, self.renormalize, self.quant = tp, top_k, renormalize, quant
        self.local_inter = tp.shard(intermediate, "moe_intermediate_size")
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        dtype = FP8_DTYPE if quant else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local_inter, dtype=dtype), requires_grad=False)
        self.w13_scale_inv = self.w2_scale_inv = None
        if quant:
            self.w13_scale_inv, self.w2_scale_inv = (
                nn.Parameter(torch.empty(num_experts, *quant.scale_shape(*w.shape[1:]), dtype=torch.float32),
                             requires_grad=False) for w in (self.w13, self.w2))
        for pair in ((self.w13, self.w13_scale_inv), (self.w2, self.w2_scale_inv)):
            for param in pair:
                if param is not None:
                    param.weight_loader = self.load_expert
                    param.num_shards = num_experts * (2 if pair[0] is self.w13 else 1)

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        """shard_id = (expert, 0 gate | 1 up | 0 down); weights or (FP8) their scales."""
        expert, part = shard_id
        n, start = self.local_inter, self.tp.rank * self.local_inter
        if param is self.w13:
            check_shape(param, loaded.narrow(0, start, n), param.data[expert].narrow(0, part * n, n))
        elif param is self.w2:
            check_shape(param, loaded.narrow(1, start, n), param.data[expert])
        elif param is self.w13_scale_inv:
            rows = self.quant.scale_rows
            check_shape(param, narrow_scale(loaded, 0, start, n, rows),
                        narrow_scale(param.data[expert], 0, part * n, n, rows))
        else:
            cols = self.quant.group if self.quant.block else None
            check_shape(param, narrow_scale(loaded, 1, start, n, cols), param.data[expert])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x.is_cuda and fused_experts is not None
        weights, ids = (route_fused if fused else route)(self.gate(x), self.top_k, self.renormalize)
        scales = (self.w13_scale_inv, self.w2_scale_inv) if self.quant else None
        experts = pick_experts(x.shape[0], fused)
        return self.tp.all_reduce(experts(x, self.w13, self.w2, weights, ids, scales=scales, fp8=self.quant))
