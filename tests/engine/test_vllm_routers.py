"""benchmarks/vllm_offline.py's `spread_routers`: the peer's dummy MoE routers, whose e4m3 rounding leaves their
logits nearly equal, get weights that spread tokens over the experts. vLLM itself is not installed here: the
modules below are laid out as its Qwen3-MoE model names them (`...mlp.gate`, `...mlp.gate_up_proj`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from vllm_offline import spread_routers  # noqa: E402

HIDDEN, EXPERTS, TOP_K = 256, 32, 4


class Fp8Router(nn.Module):
    """A router quantized as vLLM quantizes it under an FP8 config: e4m3 weights, one scale per 128x128 block."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.full((1, HIDDEN // 128), 1e-3), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.weight_scale_inv.repeat_interleave(128, dim=1)[:, : HIDDEN]
        return x @ (self.weight.float() * scales).T


def dummy_uniform(*shape: int) -> torch.Tensor:
    """vLLM's dummy weights: uniform in [-0.001, 0.001]."""
    return torch.empty(shape).uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))


def moe_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList()
    for router in (Fp8Router(dummy_uniform(EXPERTS, HIDDEN)), nn.Linear(HIDDEN, EXPERTS, bias=False)):
        layer, mlp = nn.Module(), nn.Module()
        mlp.gate = router
        mlp.gate_up_proj = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        layer.mlp = mlp
        model.layers.append(layer)
    with torch.no_grad():
        model.layers[1].mlp.gate.weight.copy_(dummy_uniform(EXPERTS, HIDDEN))
    return model


def experts_used(logits: torch.Tensor) -> int:
    return logits.topk(TOP_K, dim=-1).indices.unique().numel()


def test_spread_routers_set_every_router_and_nothing_else():
    model = moe_model()
    fp8, plain = model.layers[0].mlp.gate, model.layers[1].mlp.gate
    projection = model.layers[0].mlp.gate_up_proj.weight.clone()
    assert (fp8.weight.float() != 0).float().mean() < 0.05  # e4m3 rounds vLLM's dummy values to zero

    assert spread_routers(model) == 2

    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, projection)
    assert torch.all(fp8.weight_scale_inv == 0.02)
    assert (fp8.weight.float() != 0).float().mean() > 0.99
    assert abs(plain.weight.std().item() - 0.02) < 0.002
    # as minisgl's dummy routers do: 64 tokens' top-4 reach nearly every one of the 32 experts
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert experts_used(fp8.logits(x)) >= 28 and experts_used(plain(x)) >= 28
