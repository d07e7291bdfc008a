"""Sparse mixture-of-experts: top-k routing and the expert computation.

Experts are tensor-parallel along their intermediate dimension: every rank holds a slice of every
expert, and the partial outputs are all-reduced, exactly as a row-parallel MLP. On CUDA the experts run
in the fused Triton kernel (`minisgl.kernels.fused_moe`); `experts_torch` is its reference and the path
everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import check_shape

try:
    from minisgl.kernels.fused_moe import fused_experts, route_fused
except ImportError:  # no Triton: the torch path everywhere
    fused_experts = route_fused = None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, keep the top k; optionally renormalise them to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Reference: each expert runs on the tokens routed to it; outputs are summed, weighted.

    w13: [E, 2 * I, H] (gate rows then up rows), w2: [E, H, I], weights/ids: [T, top_k].
    """
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        h = F.linear(silu_and_mul(F.linear(x[token], w13[expert])), w2[expert])
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 tp: TPGroup):
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        self.local_inter = tp.shard(intermediate, "moe_intermediate_size")
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local_inter), requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self.load_expert
        self.w13.num_shards, self.w2.num_shards = 2 * num_experts, num_experts

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        """shard_id = (expert, 0 gate | 1 up | 0 down)."""
        expert, part = shard_id
        n = self.local_inter
        if param is self.w13:
            check_shape(param, loaded.narrow(0, self.tp.rank * n, n), param.data[expert].narrow(0, part * n, n))
        else:
            check_shape(param, loaded.narrow(1, self.tp.rank * n, n), param.data[expert])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x.is_cuda and fused_experts is not None
        weights, ids = (route_fused if fused else route)(self.gate(x), self.top_k, self.renormalize)
        return self.tp.all_reduce((fused_experts if fused else experts_torch)(x, self.w13, self.w2, weights, ids))
