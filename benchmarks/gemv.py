"""The split-K GEMV kernel against F.linear (cuBLAS) at the decode projections of qwen3-0.6b and qwen3-8b.

    python benchmarks/gemv.py                # TP 1 and 2, M = 1 2 4 8: check, then us per call and GB/s
    python benchmarks/gemv.py --sweep --tp 1 # also candidate configs per shape (timed at M = 1 and 8);
                                             # prints the winners as rows to paste into gemv.CONFIGS

Each shape is first checked against F.linear, then timed as the engine runs it: a CUDA graph of calls is
replayed and the time per call is the replay time over the calls (ops.time_per_call). A decode step reads
every weight of the model once, far more than the L2 cache holds, so the calls cycle through copies of
the weight (ROTATE_BYTES in all): each call reads its weight from HBM, as in the engine. GB/s counts the
weight's bytes. `step` rows add the four projections times the layer count plus the LM head: the GEMM
time of one decode step.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from ops import MODELS, Dims, time_per_call
from triton.runtime.errors import OutOfResources

from minisgl.kernels.gemv import CONFIGS, GemvConfig, default_config, gemv

ROTATE_BYTES = 512 << 20
SWEEP_M = (1, 8)
MIN_CALLS = 10


def shapes(dims: Dims, tp: int) -> dict[str, tuple[int, int]]:
    """Layer -> (N, K) of this rank's weight: column layers split N, row layers split K."""
    d = dims.head_dim
    return {"qkv": ((dims.heads + 2 * dims.kv_heads) * d // tp, dims.hidden), "o": (dims.hidden, dims.heads * d // tp),
            "gate_up": (2 * dims.intermediate // tp, dims.hidden), "down": (dims.hidden, dims.intermediate // tp),
            "lm_head": (-(-dims.vocab // tp), dims.hidden)}


def candidates(n: int, k: int) -> list[GemvConfig]:
    """Tiles of 16-64 rows x 128-512 columns, K split so that there are 128-1024 programs (or not split),
    at two warp/stage settings; and default_config's pick."""
    found = {default_config(n, k)}
    for block_n, block_k in itertools.product((16, 32, 64), (128, 256, 512)):
        tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        for split_k in (1, 2, 4, 8, 16):
            if split_k <= k_tiles and (split_k == 1 or 128 <= tiles * split_k <= 1024):
                found |= {GemvConfig(block_n, block_k, split_k, num_warps, num_stages)
                          for num_warps, num_stages in ((4, 3), (8, 4))}
    return sorted(found, key=repr)


class Shape:
    """One weight shape in bf16: its rotating copies and the activations for each M."""

    def __init__(self, n: int, k: int, gen: torch.Generator):
        self.n, self.k = n, k
        weight = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16()
        copies = max(1, -(-ROTATE_BYTES // weight.nbytes))
        self.weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        self.calls = max(copies, MIN_CALLS)
        self.x = {m: torch.randn(m, k, device="cuda", generator=gen).bfloat16() for m in range(1, 17)}

    def check(self, m: int) -> None:
        x, w = self.x[m], self.weights[0]
        want = F.linear(x, w).float()
        err = ((gemv(x, w).float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"gemv disagrees with F.linear at N={self.n} K={self.k} M={m}: {err:.2e}"

    def time(self, m: int, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], replays: int) -> float:
        """us per call of fn(x, weight), cycling through the copies."""
        x, weights = self.x[m], itertools.cycle(self.weights)
        return time_per_call(lambda: fn(x, next(weights)), self.calls, replays)

    def gbps(self, us: float) -> float:
        return self.weights[0].nbytes / us / 1e3


def sweep(shape: Shape, replays: int) -> tuple[GemvConfig, dict[int, float], dict[int, float]]:
    """The candidate with the least total time over SWEEP_M; its times and F.linear's per M."""
    timed = []
    for config in candidates(shape.n, shape.k):
        try:
            times = {m: shape.time(m, lambda x, w, c=config: gemv(x, w, None, c), replays) for m in SWEEP_M}
        except OutOfResources:  # a tile and pipeline depth over the SM's shared memory: not a candidate here
            continue
        timed.append((sum(times.values()), config, times))
    _, best, best_times = min(timed, key=lambda row: row[0])
    return best, best_times, {m: shape.time(m, F.linear, replays) for m in SWEEP_M}


def config_row(name: str, n: int, k: int, config: GemvConfig, times: dict[int, float], cublas: dict[int, float]) -> str:
    """A CONFIGS row under a comment with its times, commented out itself where F.linear was faster (use_gemv
    routes only the rows kept)."""
    figures = ", ".join(f"M={m} {times[m]:.1f} vs {cublas[m]:.1f} us" for m in SWEEP_M)
    keep = sum(times.values()) < sum(cublas.values())
    return f"    # {name}: {figures} (gemv vs F.linear)\n    {'' if keep else '# '}({n}, {k}): {config!r},"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8], help="rows of x (decode batch)")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="time candidate configs, print the best as rows")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, bfloat16, us per call (CUDA graph replay, weights from HBM)")
    print(f"{'model':<11} {'tp':>2} {'layer':<8} {'N':>6} {'K':>6} {'M':>2} {'F.linear':>9} {'gemv':>8} "
          f"{'speedup':>7} {'GB/s':>6} {'(cuBLAS)':>8}  config")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, tp in itertools.product(args.models, args.tp):
            dims = MODELS[name]
            step = {m: [0.0, 0.0] for m in args.m}
            for layer, (n, k) in shapes(dims, tp).items():
                shape = Shape(n, k, gen)
                count = 1 if layer == "lm_head" else dims.layers
                config = CONFIGS.get((n, k)) or default_config(n, k)
                for m in args.m:
                    shape.check(m)
                    t_ref, t_gemv = shape.time(m, F.linear, args.replays), shape.time(m, gemv, args.replays)
                    step[m][0] += count * t_ref
                    step[m][1] += count * t_gemv
                    print(f"{name:<11} {tp:>2} {layer:<8} {n:>6} {k:>6} {m:>2} {t_ref:>9.1f} {t_gemv:>8.1f} "
                          f"{t_ref / t_gemv:>6.2f}x {shape.gbps(t_gemv):>6.0f} {shape.gbps(t_ref):>8.0f}  "
                          f"{'' if (n, k) in CONFIGS else 'default '}{config}", flush=True)
                if args.sweep:
                    rows.append(config_row(f"{name} TP{tp} {layer}", n, k, *sweep(shape, args.replays)))
                    print(rows[-1], flush=True)
                del shape
            for m, (t_ref, t_gemv) in step.items():
                print(f"{name:<11} {tp:>2} {'step':<8} {'':>6} {'':>6} {m:>2} {t_ref:>9.1f} {t_gemv:>8.1f} "
                      f"{t_ref / t_gemv:>6.2f}x", flush=True)
    if rows:
        print("\n== CONFIGS rows for minisgl/kernels/gemv.py (commented out: F.linear was faster)")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
