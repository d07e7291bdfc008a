"""GPU micro-benchmark of the fused small ops against their torch reference, at decode and prefill sizes.

    python benchmarks/ops.py [--models qwen3-0.6b qwen3-8b] [--tokens 1 32 256 8192]

Each op is timed as the engine runs it under CUDA graphs: a graph of `--calls` back-to-back calls is
captured and replayed, and the time per call is the replay time divided by the calls, so CPU launch
overhead is excluded and the GPU's per-kernel cost is included. The `layer x N` row adds one layer's
ops (two add+RMSNorm, one q/k-norm+rope with the K/V store, one SiLU-and-mul) and multiplies by the model's layer count:
what these ops cost per forward step. At decode sizes, `sampling` compares `Sampler.sample` on
temperature-only rows with the fused exponential race (tokens = batch rows). Prints one table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from minisgl.core import SamplingParams
from minisgl.engine.sampler import Sampler
from minisgl.kernels.activation import silu_and_mul
from minisgl.kernels.norm import add_rms_norm
from minisgl.kernels.rotary import qk_norm_rope_store
from minisgl.kernels.sampling import sample_exponential_race
from minisgl.kvcache.pool import KVPool
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding


@dataclass
class Dims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int


# From the models' config.json files (TP = 1).
MODELS = {
    "qwen3-0.6b": Dims(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, layers=28,
                         vocab=151936),
    "qwen3-8b": Dims(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, layers=36,
                       vocab=151936),
}


def time_per_call(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the Triton kernels) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def op_pairs(dims: Dims, tokens: int) -> dict[str, tuple[Callable[[], object], Callable[[], object], int]]:
    """name -> (torch reference, fused kernel, calls per layer), on random bf16 inputs of one step."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    d = dims.head_dim
    norm = RMSNorm(dims.hidden, 1e-6).to(cuda, bf16)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(cuda, bf16), RMSNorm(d, 1e-6).to(cuda, bf16)
    rope = RotaryEmbedding(d, 40960, 1e6, None).to(cuda)
    x = torch.randn(tokens, dims.hidden, device=cuda, dtype=bf16)
    residual = torch.randn_like(x)
    qkv = torch.randn(tokens, (dims.heads + 2 * dims.kv_heads) * d, device=cuda, dtype=bf16)
    q, k, v = qkv.split([dims.heads * d, dims.kv_heads * d, dims.kv_heads * d], dim=-1)
    q, k, v = q.view(tokens, dims.heads, d), k.view(tokens, dims.kv_heads, d), v.view(tokens, dims.kv_heads, d)
    positions = torch.randint(0, 40960, (tokens,), device=cuda)
    pool = KVPool(1, tokens, 1, dims.kv_heads, d, bf16, cuda)  # one layer, a slot per token
    slots = torch.randperm(tokens, device=cuda)

    def rope_then_store():
        q_out, k_out = rope.forward_torch(positions, q, k, q_norm, k_norm)
        pool.store(0, slots, k_out, v)
        return q_out
    gate_up = torch.randn(tokens, 2 * dims.intermediate, device=cuda, dtype=bf16)
    return {
        "add+rmsnorm": (lambda: norm.forward_torch(x, residual),
                        lambda: add_rms_norm(x, residual, norm.weight, norm.eps), 2),
        "qk-norm+rope+store": (rope_then_store,
                               lambda: qk_norm_rope_store(q, k, v, positions, rope.cos, rope.sin, pool.k[0], pool.v[0],
                                                          slots, q_norm.weight, k_norm.weight, q_norm.eps), 1),
        "silu-and-mul": (lambda: silu_and_mul_torch(gate_up), lambda: silu_and_mul(gate_up), 1),
    }


def sampling_pair(dims: Dims, batch: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(Sampler.sample, the fused race) on `batch` rows sampling at temperature 0.6 from random logits."""
    sampler = Sampler(batch, dims.vocab, "cuda")
    for row in range(batch):
        sampler.prepare_row(row, SamplingParams(temperature=0.6), row, [1], [], [])
    rows = torch.arange(batch, device="cuda")
    logits = torch.randn(batch, dims.vocab, device="cuda")
    temperature, seeds, generated = sampler.floats[:, 0], sampler.ints[:, 2:], sampler.generated
    return (lambda: sampler.sample(logits, rows),
            lambda: sample_exponential_race(logits, temperature, seeds, generated))


def print_row(model: str, tokens: int, op: str, t_torch: float, t_fused: float) -> None:
    print(f"{model:<11} {tokens:>6} {op:<15} {t_torch:>10.1f} {t_fused:>10.1f} {t_torch / t_fused:>7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 256, 8192])
    parser.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, bfloat16, us per call (CUDA graph replay)")
    print(f"{'model':<11} {'tokens':>6} {'op':<15} {'torch':>10} {'fused':>10} {'speedup':>8}")
    with torch.no_grad():
        for name in args.models:
            dims = MODELS[name]
            for tokens in args.tokens:
                step_torch = step_fused = 0.0
                for op, (reference, fused, per_layer) in op_pairs(dims, tokens).items():
                    t_torch = time_per_call(reference, args.calls, args.replays)
                    t_fused = time_per_call(fused, args.calls, args.replays)
                    step_torch, step_fused = step_torch + per_layer * t_torch, step_fused + per_layer * t_fused
                    print_row(name, tokens, op, t_torch, t_fused)
                print_row(name, tokens, f"layer x {dims.layers}", step_torch * dims.layers, step_fused * dims.layers)
                if tokens <= 1024:
                    reference, fused = sampling_pair(dims, tokens)
                    print_row(name, tokens, "sampling", time_per_call(reference, args.calls, args.replays),
                        time_per_call(fused, args.calls, args.replays))


if __name__ == "__main__":
    main()
