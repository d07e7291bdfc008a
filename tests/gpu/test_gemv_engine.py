"""The split-K GEMV kernel on a GPU: replayed from a CUDA graph, deterministic across runs, and inside the
engine (GPU only: see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_llm
from test_fast_path import PARAMS, PROMPTS, assert_same_greedy

from minisgl.kernels import gemv as gemv_module
from minisgl.kernels.gemv import GemvConfig, arrival_counters, gemv
from minisgl.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from minisgl.layers import linear as linear_layer

SPLIT = GemvConfig(block_n=16, block_k=64, split_k=8)


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
            (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16(),
            torch.randn(n, device="cuda", generator=gen).bfloat16())


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float(), b.float()).bfloat16()


def test_split_k_gemv_replays_in_cuda_graph():
    """Captured once, replayed on new rows of x: the counters and the workspace work across replays."""
    x, w, b = operands(5, 1000, 3000, seed=0)
    gemv(x, w, b, SPLIT)  # compiles and creates the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, b, SPLIT)
    for seed in (1, 2, 3):
        x.copy_(operands(5, 1000, 3000, seed)[0])
        graph.replay()
        torch.testing.assert_close(out, reference(x, w, b), rtol=2e-2, atol=2e-2)
    assert not arrival_counters(x.device).any()


def test_split_k_sum_does_not_depend_on_arrival_order():
    """Many tiles whose slices finish in a different order each run: the same bits every time, and right
    (a partial read before its writer's store is visible would show here as a wrong or varying result)."""
    x, w, b = operands(8, 6144, 4096, seed=4)
    first = gemv(x, w, b, SPLIT)
    torch.testing.assert_close(first, reference(x, w, b), rtol=2e-2, atol=2e-2)
    for _ in range(50):
        assert torch.equal(gemv(x, w, b, SPLIT), first)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen2: q/k/v biases through the kernel
def test_engine_on_gemv_matches_cublas(tiny_models, monkeypatch, arch):
    """Every projection and the LM head of a tiny model get a split-K row in the config table, so decode
    (CUDA graphs up to batch 8) and short prefills run on the kernel: greedy tokens and logprobs match the
    same engine on F.linear (the tiny shapes have no rows of their own)."""
    path = tiny_models[arch]
    cublas = make_llm(path, dtype="bfloat16")
    want = cublas.generate(PROMPTS, PARAMS)
    layers = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    shapes = {tuple(mod.weight.shape) for mod in cublas.engine.model.modules() if isinstance(mod, layers)}
    for n, k in shapes:
        monkeypatch.setitem(gemv_module.CONFIGS, (n, k), GemvConfig(block_n=16, block_k=32, split_k=2))
    launched = []

    def counted_gemv(*args, **kwargs):
        launched.append(tuple(args[1].shape))
        return gemv(*args, **kwargs)

    monkeypatch.setattr(linear_layer, "gemv", counted_gemv)
    got = make_llm(path, dtype="bfloat16").generate(PROMPTS, PARAMS)
    assert set(launched) == shapes and len(shapes) == 5  # qkv, o, gate_up, down and the LM head
    assert_same_greedy(got, want)
