"""FP8 weights against bf16 at qwen3-8b's projections (TP 1): the decode GEMV and the prefill GEMM.

    python benchmarks/fp8.py            # us per call: bf16 (the engine's path: gemv or F.linear) vs FP8
    python benchmarks/fp8.py --sweep    # also FP8 GEMV candidates per shape; prints rows for gemv.FP8_CONFIGS

Timed as benchmarks/gemv.py times (CUDA-graph replay, the weight cycled through copies so that each call
reads it from HBM). Block-scaled weights (128 x 128), as Qwen/Qwen3-8B-FP8. The FP8 GEMM's time includes
its activation-quantization launch.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from gemv import ROTATE_BYTES, shapes
from ops import MODELS, time_per_call
from triton.runtime.errors import OutOfResources

from minisgl.kernels.fp8 import fp8_gemm
from minisgl.kernels.gemv import CONFIGS, FP8_CONFIGS, GemvConfig, default_config, gemv, use_gemv
from minisgl.layers.fp8 import Fp8Config, quantize_weight

BLOCK = Fp8Config(block=(128, 128))
DECODE_M = (1, 8)
PREFILL_M = (16, 64, 256, 1024, 4096)


def rotated(weight: torch.Tensor) -> tuple[itertools.cycle, int]:
    """Copies of the weight that together exceed the L2 cache many times over; calls per graph."""
    copies = max(1, -(-ROTATE_BYTES // weight.nbytes))
    return itertools.cycle([weight.clone() for _ in range(copies)]), max(copies, 10)


def fp8_candidates(n: int, k: int) -> list[GemvConfig]:
    """Tiles of 32-256 rows x one 128-column group, K split so that there are 128-1024 programs."""
    found = {default_config(n, k, 128, 128)}
    for block_n, split_k, (warps, stages) in itertools.product((32, 64, 128, 256), (1, 2, 4, 8, 16),
                                                               ((4, 3), (4, 4), (8, 4))):
        programs = triton.cdiv(n, block_n) * split_k
        if split_k <= triton.cdiv(k, 128) and (split_k == 1 or 128 <= programs <= 1024):
            found.add(GemvConfig(block_n, 128, split_k, warps, stages))
    return sorted(found, key=repr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args()
    dims = MODELS["qwen3-8b"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, qwen3-8b TP 1, us per call (CUDA graph replay, weights from HBM)")
    step = {m: [0.0, 0.0] for m in DECODE_M + PREFILL_M}
    rows = []
    with torch.inference_mode():
        for layer, (n, k) in shapes(dims, 1).items():
            if layer == "lm_head":  # bf16 in the FP8 checkpoints too
                continue
            w = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16()
            wq, scale = quantize_weight(w, BLOCK)
            bf16, calls = rotated(w)
            fp8, fp8_calls = rotated(wq)
            for m in DECODE_M + PREFILL_M:
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                t_bf16 = time_per_call(lambda: (gemv if use_gemv(m, n, k) else F.linear)(x, next(bf16)), calls,
                                       args.replays)
                if m in DECODE_M:
                    t_fp8 = time_per_call(lambda: gemv(x, next(fp8), scale=scale, fp8=BLOCK), fp8_calls,
                                          args.replays)
                else:
                    t_fp8 = time_per_call(lambda: fp8_gemm(x, next(fp8), scale, BLOCK), fp8_calls, args.replays)
                step[m][0] += dims.layers * t_bf16
                step[m][1] += dims.layers * t_fp8
                print(f"{layer:<8} {n:>6} {k:>6} M={m:<5} bf16 {t_bf16:>8.1f}  fp8 {t_fp8:>8.1f}  "
                      f"{t_bf16 / t_fp8:.2f}x  fp8 GB/s {wq.nbytes / t_fp8 / 1e3:>5.0f}", flush=True)
            if args.sweep:
                timed, xs = [], [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for m in DECODE_M]
                for config in fp8_candidates(n, k):
                    try:
                        times = [time_per_call(lambda: gemv(x, next(fp8), None, config, scale=scale, fp8=BLOCK),
                                               fp8_calls, args.replays) for x in xs]
                    except OutOfResources:
                        continue
                    timed.append((sum(times), config, times))
                _, best, times = min(timed, key=lambda row: row[0])
                rows.append(f"    # qwen3-8b TP1 {layer}: M=1 {times[0]:.1f} us, M=8 {times[1]:.1f} us\n"
                            f"    ({n}, {k}): {best!r},")
                print(rows[-1], flush=True)
    for m, (t_bf16, t_fp8) in step.items():
        print(f"step (4 projections x {dims.layers} layers) M={m:<5} bf16 {t_bf16:>9.1f} us  fp8 {t_fp8:>9.1f} us  "
              f"{t_bf16 / t_fp8:.2f}x", flush=True)
    if rows:
        print("\n== FP8_CONFIGS rows for minisgl/kernels/gemv.py (current: "
              f"{len(FP8_CONFIGS)} rows; bf16 CONFIGS {len(CONFIGS)})")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
