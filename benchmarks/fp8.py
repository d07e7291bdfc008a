"""FP8 weights against bf16 at the projections of qwen3-8b and qwen3-30b-a3b (TP 1), each through the engine's own
dispatch (qwen3-30b-a3b: attention's qkv and o; its MLPs are experts, benchmarks/moe.py). `--models` picks them;
the tables are rewritten with the rows of the models timed.

    python benchmarks/fp8.py                   # us per call: bf16 (gemv or F.linear) vs FP8 (GEMV or GEMM)
    python benchmarks/fp8.py --sweep           # first tune: FP8 GEMV candidates per shape (M = 1 and 8) and
                                               # FP8 GEMM tiles per shape and M (SWEEP_GEMM_M); prints rows
    python benchmarks/fp8.py --sweep --write   # ... and rewrites gemv.FP8_CONFIGS and fp8.FP8_GEMM_CONFIGS
    python benchmarks/fp8.py --rows 1 8        # only these batch sizes
    python benchmarks/fp8.py --chain           # a decode step's projections and norms, all 36 layers
    python benchmarks/fp8.py --cublas          # prefill-sized batches: the Triton FP8 GEMM against cuBLAS's
                                               # block-scaled FP8 GEMM (and bf16), M = 32..8192 (CUBLAS_M)
    python benchmarks/fp8.py --cublas --write  # ... and rewrites fp8_cublas.CUBLAS_FP8_MIN_M
    python benchmarks/fp8.py --silu-mul        # qwen3-8b's down projection at prefill sizes: SiLU-and-mul as its
                                               # own launch before the quantization, against inside it
    MINISGL_NATIVE_GEMV=1 python benchmarks/fp8.py --chain   # ... with csrc's GEMV for the FP8 projections
                                                             # (=widen / =mma: only that variant)

The sweep's winners replace the tables in memory before the comparison runs, so its figures are the
tuned ones. Each projection is timed as the model runs it (down with SiLU-and-mul inside), and the bf16 LM
head (FP8 checkpoints keep it in bf16) after them. Timed as benchmarks/gemv.py times (CUDA-graph replay,
the weight cycled through copies so that each call reads it from HBM). Block-scaled weights (128 x 128), as
Qwen/Qwen3-8B-FP8. The FP8 GEMM's time includes its activation-quantization launch. At 16 rows, the most
that FP8 layers send to the GEMV, the GEMM's time is printed too (the reason for the routing).

`--chain` times what a decode step runs around attention, layer after layer as the model does (each layer's
own weights, so that every read comes from HBM): add+RMSNorm, qkv, o (on qkv's first columns), add+RMSNorm,
gate_up, SiLU-and-mul, down; bf16 and FP8, with SiLU-and-mul as its own launch or inside down's GEMV, and with
programmatic dependent launch off and on.

`--cublas` times each projection at each M of CUBLAS_M three ways (the time of both FP8 paths includes their
activation-quantization launch): the Triton GEMM, cuBLAS's (`fp8_cublas.fp8_scaled_mm`) and bf16 F.linear;
prints CUBLAS_FP8_MIN_M's rows (the smallest M from which cuBLAS was the faster at every larger M timed), and
last the four projections' sum per M, times the layers (a prefill step's GEMM time).

`--silu-mul` times, at each M of CUBLAS_M, the down projection's activation two ways: silu_and_mul's launch then
`quantize_activation` (the path before they were fused), against `quantize_activation(silu_mul=True)`; and the
whole projection through the layers' dispatch both ways (`fp8_linear` of silu_and_mul's output, against
`fp8_linear(silu_mul=True)`). Last, the saving per 1,000 tokens over all layers.

Where csrc's CUDA GEMVs are built (`python -m minisgl.tools.build_csrc`) and the GPU is a Hopper, each
variant's time at each of its CTA heights (mma/16, mma/32 up to 8 rows; widen/8, widen/16 up to 2) is printed
beside the Triton GEMV's at the batch sizes it serves (down with SiLU-and-mul inside, as the model runs it),
with the rows of `native.NATIVE_FP8_GEMV` for the (M, N, K) where the fastest of them beat the Triton GEMV.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import torch
import triton
from gemv import ROTATE_BYTES, shapes
from ops import MODELS, Dims, time_per_call
from triton.runtime.errors import OutOfResources

import minisgl.kernels
from minisgl.kernels import fp8 as fp8_kernels
from minisgl.kernels import fp8_cublas, native
from minisgl.kernels import gemv as gemv_kernels
from minisgl.kernels.fp8 import FP8_GEMM_CONFIGS, Fp8GemmConfig, fp8_gemm, pick_config
from minisgl.kernels.gemv import BLOCK_M, FP8_CONFIGS, GemvConfig, default_config, gemv
from minisgl.kernels.norm import add_rms_norm
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.fp8 import quantize_weight
from minisgl.layers.linear import fp8_linear, linear
from minisgl.quantization import Fp8Config

BLOCK = Fp8Config(block=(128, 128))
ROWS = (1, 8, 16, 64, 128, 256, 1024, 4096)
SWEEP_GEMV_M = (1, 8)
SWEEP_GEMM_M = (128, 256, 4096)  # table rows: each serves the batches up to it (the last, all above)
CUBLAS_M = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# model -> (dims, its dense FP8 projections); from the models' config.json files
FP8_MODELS = {
    "qwen3-8b": (MODELS["qwen3-8b"], ("qkv", "o", "gate_up", "down")),
    "qwen3-30b-a3b": (Dims(hidden=2048, intermediate=768, heads=32, kv_heads=4, head_dim=128, layers=48,
                           vocab=151936), ("qkv", "o")),
}


def projections(model: str) -> dict[str, tuple[int, int]]:
    """The model's dense FP8 projections -> (N, K) at TP 1 (the LM head stays bf16 in FP8 checkpoints)."""
    dims, names = FP8_MODELS[model]
    return {name: nk for name, nk in shapes(dims, 1).items() if name in names}


def rotated(weight: torch.Tensor) -> tuple[itertools.cycle, int]:
    """Copies of the weight that together exceed the L2 cache many times over; calls per graph."""
    copies = max(1, -(-ROTATE_BYTES // weight.nbytes))
    return itertools.cycle([weight.clone() for _ in range(copies)]), max(copies, 10)


def gemv_candidates(n: int, k: int) -> list[GemvConfig]:
    """Tiles of 32-256 rows x one 128-column group, K split so that there are 128-1024 programs."""
    found = {default_config(n, k, 128, 128)}
    for block_n, split_k, (warps, stages) in itertools.product((32, 64, 128, 256), (1, 2, 4, 8, 16),
                                                               ((4, 3), (4, 4), (8, 4))):
        programs = triton.cdiv(n, block_n) * split_k
        if split_k <= triton.cdiv(k, 128) and (split_k == 1 or 128 <= programs <= 1024):
            found.add(GemvConfig(block_n, 128, split_k, warps, stages))
    return sorted(found, key=repr)


def gemm_candidates(m: int) -> list[Fp8GemmConfig]:
    """Row tiles of 64 or 128 (not above M's power of two), 64-256 columns, 4 or 8 warps, 3 or 4 stages."""
    found = {fp8_kernels.default_gemm_config(m)}
    for block_m, block_n, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if block_m <= max(64, triton.next_power_of_2(m)) and not (block_m * block_n >= 128 * 256 and warps == 4):
            found.add(Fp8GemmConfig(block_m, block_n, 8, warps, stages))
    return sorted(found, key=repr)


def fastest(configs, time) -> tuple[float, object]:
    """(time, config) of the fastest config that compiles."""
    timed = []
    for config in configs:
        try:
            timed.append((time(config), config))
        except OutOfResources:
            continue
    return min(timed, key=lambda row: row[0])


def chain(dims, gen: torch.Generator, replays: int) -> None:
    """us per decode step of every layer's projections and norms (see the module docstring), per variant."""
    layers = {name: nk for name, nk in shapes(dims, 1).items() if name != "lm_head"}
    weights = []
    for _ in range(dims.layers):
        per_layer = {}
        for name, (n, k) in layers.items():
            w = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16()
            per_layer[name] = (w, *quantize_weight(w, BLOCK))
        weights.append(per_layer)
    norm = torch.ones(dims.hidden, device="cuda", dtype=torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())  # the key use_pdl caches under

    def project(h, weight, fp8, silu_mul=False):
        w, wq, scale = weight
        return fp8_linear(h, wq, scale, BLOCK, silu_mul=silu_mul) if fp8 else linear(h, w, silu_mul=silu_mul)

    def step(x, fp8, fused):
        residual = x
        for layer in weights:
            h, residual = add_rms_norm(x, residual, norm, 1e-6)
            qkv = project(h, layer["qkv"], fp8)
            h, residual = add_rms_norm(project(qkv[:, : dims.heads * dims.head_dim], layer["o"], fp8), residual,
                                       norm, 1e-6)
            gate_up = project(h, layer["gate_up"], fp8)
            x = project(gate_up, layer["down"], fp8, True) if fused else project(silu_and_mul(gate_up),
                                                                                  layer["down"], fp8)
        return x

    pdl_modes = (False, True) if minisgl.kernels.use_pdl(device) else (False,)  # MINISGL_PDL=0, or before Hopper
    print(f"\n{torch.cuda.get_device_name()}: one decode step's projections and norms, {dims.layers} layers, us")
    print("| rows | weights | SiLU-and-mul | PDL off | PDL on |\n|---|---|---|---|---|")
    for m in (1, 8):
        x = torch.randn(m, dims.hidden, device="cuda", generator=gen).bfloat16()
        for fp8, fused in itertools.product((False, True), (False, True)):
            times = []
            for pdl in pdl_modes:
                minisgl.kernels._pdl[device] = pdl
                times.append(f"{time_per_call(lambda: step(x, fp8, fused), 1, replays):,.0f}")
            minisgl.kernels._pdl.pop(device)
            print(f"| {m} | {'FP8' if fp8 else 'bf16'} | {'in down' if fused else 'own launch'} | "
                  + " | ".join(times) + " |", flush=True)


def cublas_min_m(times: dict[int, tuple[float, float, float]]) -> int | None:
    """The smallest M from which cuBLAS (times[m][2]) beat the Triton GEMM (times[m][1]) at every larger M."""
    found = None
    for m in sorted(times, reverse=True):
        if times[m][2] >= times[m][1]:
            break
        found = m
    return found


def cublas(model: str, gen: torch.Generator, replays: int) -> list[str]:
    """us per call of the Triton FP8 GEMM, cuBLAS's FP8 GEMM and bf16 at prefill-sized batches (module docstring);
    the model's rows of CUBLAS_FP8_MIN_M."""
    device = torch.cuda.get_device_name()
    cuda = torch.device("cuda", torch.cuda.current_device())
    reason = fp8_cublas.unavailable(cuda, torch.bfloat16)
    assert reason is None, f"cuBLAS's block-scaled FP8 GEMM cannot run here: {reason}"
    dims, layers = FP8_MODELS[model][0], projections(model)
    xs = {m: torch.randn(m, max(k for _, k in layers.values()), device="cuda", generator=gen).bfloat16()
          for m in CUBLAS_M}
    print(f"{device}, {model} TP 1, us per call (CUDA graph replay, weights from HBM), FP8 with its quantization")
    step = {m: [0.0, 0.0, 0.0] for m in CUBLAS_M}  # bf16, Triton FP8, cuBLAS FP8
    rows = []
    for layer, (n, k) in layers.items():
        w = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16()
        wq, scale = quantize_weight(w, BLOCK)
        bf16, calls = rotated(w)
        fp8, fp8_calls = rotated(wq)
        times = {}
        for m in CUBLAS_M:
            x = xs[m][:, :k]
            times[m] = (time_per_call(lambda: torch.nn.functional.linear(x, next(bf16)), calls, replays),
                        time_per_call(lambda: fp8_gemm(x, next(fp8), scale, BLOCK), fp8_calls, replays),
                        time_per_call(lambda: fp8_cublas.fp8_scaled_mm(x, next(fp8), scale, BLOCK), fp8_calls,
                                      replays))
            for i, t in enumerate(times[m]):
                step[m][i] += dims.layers * t
            t_bf16, t_triton, t_cublas = times[m]
            print(f"{layer:<8} {n:>6} {k:>6} M={m:<5} bf16 {t_bf16:>8.1f}  triton {t_triton:>8.1f}  cublas "
                  f"{t_cublas:>8.1f}  cublas/triton {t_cublas / t_triton:.2f}  cublas/bf16 {t_cublas / t_bf16:.2f}",
                  flush=True)
        rows.append(f"    # {device.removeprefix('NVIDIA ')} {model} {layer}, us at M " + ", ".join(
            f"{m}: {times[m][2]:.0f}/{times[m][1]:.0f}/{times[m][0]:.0f}" for m in (128, 256, 1024, 4096))
            + f"\n    ({n}, {k}): {cublas_min_m(times)},")
        print(rows[-1], flush=True)
    print(f"\n{device}: {model} prefill step = {len(layers)} projections x {dims.layers} layers, ms (FP8 with its "
          "quantization)")
    print("| M | bf16 | FP8 Triton | FP8 cuBLAS | cuBLAS / Triton | cuBLAS / bf16 |\n|---|---|---|---|---|---|")
    for m, (t_bf16, t_triton, t_cublas) in step.items():
        print(f"| {m} | {t_bf16 / 1e3:.2f} | {t_triton / 1e3:.2f} | {t_cublas / 1e3:.2f} | {t_cublas / t_triton:.2f}x "
              f"| {t_cublas / t_bf16:.2f}x |")
    return rows


def silu_mul_quantization(model: str, gen: torch.Generator, replays: int) -> None:
    """us per call of the down projection's activation and of the projection, SiLU-and-mul fused into the
    quantization or not (module docstring)."""
    dims = FP8_MODELS[model][0]
    n, k = projections(model)["down"]
    wq, scale = quantize_weight(torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16(), BLOCK)
    fp8, calls = rotated(wq)
    print(f"{torch.cuda.get_device_name()}, {model} TP 1 down ({n}, {k}), us per call (CUDA graph replay)")
    print("| M | silu_and_mul + quantize | fused | ratio | down, two passes | down, fused | ratio | saved ms per "
          "1,000 tokens, all layers |\n|---|---|---|---|---|---|---|---|")
    for m in CUBLAS_M:
        xg = torch.randn(m, 2 * k, device="cuda", generator=gen).bfloat16()
        t_two = time_per_call(lambda: fp8_kernels.quantize_activation(silu_and_mul(xg), BLOCK.group), 10, replays)
        t_one = time_per_call(lambda: fp8_kernels.quantize_activation(xg, BLOCK.group, silu_mul=True), 10, replays)
        d_two = time_per_call(lambda: fp8_linear(silu_and_mul(xg), next(fp8), scale, BLOCK), calls, replays)
        d_one = time_per_call(lambda: fp8_linear(xg, next(fp8), scale, BLOCK, silu_mul=True), calls, replays)
        print(f"| {m} | {t_two:.1f} | {t_one:.1f} | {t_one / t_two:.2f}x | {d_two:.1f} | {d_one:.1f} | "
              f"{d_one / d_two:.2f}x | {(d_two - d_one) * dims.layers / m:.3f} |", flush=True)


def rewrite_table(path: Path, name: str, rows: list[str]) -> None:
    """Replace the body of the dict literal `NAME: ... = {...}` in a source file with `rows`."""
    pattern = re.compile(rf"^({re.escape(name)}: [^\n]*= )\{{(?:\}}|\n.*?\n\}})$", re.M | re.S)
    source = path.read_text()
    assert pattern.search(source), f"{name} not found in {path}"
    path.write_text(pattern.sub(lambda match: match.group(1) + "{\n" + "\n".join(rows) + "\n}", source, count=1))


def projection_tables(model: str, args: argparse.Namespace, gen: torch.Generator
                      ) -> tuple[list[str], list[str], list[str]]:
    """With --sweep, tune the model's FP8 GEMV and GEMM rows (into the tables in memory); then time each projection
    at each of args.rows through the layers' dispatch, bf16 against FP8 (and csrc's GEMVs where built). Returns
    the model's rows of gemv.FP8_CONFIGS, fp8.FP8_GEMM_CONFIGS (swept, else empty) and native.NATIVE_FP8_GEMV."""
    device = torch.cuda.get_device_name()
    dims, layers = FP8_MODELS[model][0], projections(model)
    print(f"{device}, {model} TP 1, us per call (CUDA graph replay, weights from HBM)")
    weights = {}
    with torch.inference_mode():
        for layer, (n, k) in layers.items():
            w = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16()
            wq, scale = quantize_weight(w, BLOCK)
            weights[layer] = (w, wq, scale)
        xs = {m: torch.randn(m, max(k for _, k in layers.values()), device="cuda", generator=gen).bfloat16()
              for m in sorted(set(args.rows) | set(SWEEP_GEMV_M) | set(SWEEP_GEMM_M))}
        gemv_rows, gemm_rows = [], []
        for layer, (n, k) in layers.items() if args.sweep else ():
            _, wq, scale = weights[layer]
            fp8, calls = rotated(wq)
            times = {}

            def gemv_time(config: GemvConfig) -> float:
                times[config] = [time_per_call(lambda: gemv(xs[m][:, :k], next(fp8), None, config, scale=scale,
                                                            fp8=BLOCK), calls, args.sweep_replays)
                                 for m in SWEEP_GEMV_M]
                return sum(times[config])

            _, best = fastest(gemv_candidates(n, k), gemv_time)
            FP8_CONFIGS[(n, k)] = best
            gemv_rows.append(f"    # {device} {model} TP1 {layer}: M=1 {times[best][0]:.1f} us, "
                             f"M=8 {times[best][1]:.1f} us\n    ({n}, {k}): {best!r},")
            print(gemv_rows[-1], flush=True)
            picks = []
            for m in SWEEP_GEMM_M:
                t, tiles = fastest(gemm_candidates(m), lambda tiles: time_per_call(
                    lambda: fp8_gemm(xs[m][:, :k], next(fp8), scale, BLOCK, tiles=tiles), calls, args.sweep_replays))
                picks.append((m, tiles))
                gemm_rows.append(f"    # {device} {model} TP1 {layer} M={m}: {t:.1f} us")
                print(gemm_rows[-1], tiles, flush=True)
            FP8_GEMM_CONFIGS[(n, k)] = tuple(picks)
            gemm_rows += [f"    ({n}, {k}): ("] + [f"        ({m}, {tiles!r})," for m, tiles in picks] + ["    ),"]

        step = {m: [0.0, 0.0, 0.0] for m in args.rows}  # bf16, FP8, FP8 GEMM where the GEMV serves FP8
        cuda = torch.device("cuda", torch.cuda.current_device())
        why_not = native.unavailable(cuda)
        candidates = [(variant, rows) for variant, v in native.VARIANTS.items() for rows in v.rows]
        print(f"native GEMV: {why_not or 'built, timed as ' + ', '.join(f'{v}/{r}' for v, r in candidates)}")
        # (m, (variant, rows)) -> us per step, for the batch sizes each variant serves
        native_step = {(m, c): 0.0 for m in args.rows for c in candidates
                       if not why_not and m <= native.VARIANTS[c[0]].max_m}
        native_rows = []  # NATIVE_FP8_GEMV's rows to paste
        for layer, (n, k) in layers.items():
            w, wq, scale = weights[layer]
            bf16, calls = rotated(w)
            fp8, fp8_calls = rotated(wq)
            for m in args.rows:
                x = xs[m][:, :k]
                # every GEMV as the model runs it: down with SiLU-and-mul inside (x is [gate | up])
                silu = layer == "down"
                xg = torch.randn(m, 2 * k, device="cuda", generator=gen).bfloat16() if silu else x
                t_bf16 = time_per_call(lambda: linear(xg, next(bf16), silu_mul=silu), calls, args.replays)
                t_fp8 = time_per_call(lambda: fp8_linear(xg, next(fp8), scale, BLOCK, silu_mul=silu), fp8_calls,
                                      args.replays)
                t_gemm = time_per_call(lambda: fp8_gemm(x, next(fp8), scale, BLOCK), fp8_calls, args.replays) \
                    if 16 <= m <= BLOCK_M else 0.0
                for i, t in enumerate((t_bf16, t_fp8, t_gemm)):
                    step[m][i] += dims.layers * t
                t_native = {(variant, rows): time_per_call(
                    lambda: native.fp8_gemv(xg, next(fp8), scale, BLOCK, silu_mul=silu, variant=variant, rows=rows,
                                            pdl=minisgl.kernels.use_pdl(cuda)), fp8_calls, args.replays)
                    for (m_, (variant, rows)) in native_step if m_ == m}
                for c, t in t_native.items():
                    native_step[m, c] += dims.layers * t
                kernel = "gemv" if m <= BLOCK_M else f"gemm {pick_config(m, n, k)}"
                print(f"{layer:<8} {n:>6} {k:>6} M={m:<5} bf16 {t_bf16:>8.1f}  fp8 {t_fp8:>8.1f}  "
                      f"{t_bf16 / t_fp8:.2f}x  fp8 GB/s {wq.nbytes / t_fp8 / 1e3:>5.0f}"
                      + (f"  (gemm {t_gemm:.1f})" if t_gemm else "") + f"  [{kernel}]"
                      + "".join(f"  {v}/{r} {t:.1f} ({wq.nbytes / t / 1e3:.0f} GB/s)"
                                for (v, r), t in t_native.items()), flush=True)
                if t_native:  # against the Triton GEMV itself (the FP8 column is the layers' dispatch)
                    t_triton = time_per_call(lambda: gemv(xg, next(fp8), scale=scale, fp8=BLOCK, silu_mul=silu),
                                             fp8_calls, args.replays)
                    (variant, rows), t = min(t_native.items(), key=lambda item: item[1])
                    if t < t_triton:
                        native_rows.append(f"    # {device} {model} TP1 {layer} M={m}: {t:.1f} us against the "
                                           f"Triton GEMV's {t_triton:.1f}\n    ({m}, {n}, {k}): "
                                           f"(\"{variant}\", {rows}),")
        # the LM head, bf16 in FP8 checkpoints: after the projections, a decode step's largest weight read
        n, k = shapes(dims, 1)["lm_head"]
        head, calls = rotated(torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).bfloat16())
        for m in args.rows:
            t = time_per_call(lambda: linear(xs[m][:, :k], next(head)), calls, args.replays)
            print(f"lm_head  {n:>6} {k:>6} M={m:<5} bf16 {t:>8.1f}  GB/s {n * k * 2 / t / 1e3:>5.0f}", flush=True)
    print(f"\n{device}: {model} step = {len(layers)} projections x {dims.layers} layers, us")
    print("| M | bf16 | FP8 | bf16 / FP8 | FP8 GEMM instead of the GEMV | native GEMV "
          + ", ".join(f"{v}/{r}" for v, r in candidates) + " |\n|---|---|---|---|---|---|")
    for m, (t_bf16, t_fp8, t_gemm) in step.items():
        ours = " / ".join(f"{native_step[m, c]:,.0f}" if (m, c) in native_step else "-" for c in candidates)
        print(f"| {m} | {t_bf16:,.0f} | {t_fp8:,.0f} | {t_bf16 / t_fp8:.2f}x | {f'{t_gemm:,.0f}' if t_gemm else ''} "
              f"| {ours if native_step else ''} |")
    if native_step:
        print(f"\nNATIVE_FP8_GEMV rows for {model} (minisgl/kernels/native.py):\n"
              + "\n".join(native_rows or ["    (none faster)"]))
    return gemv_rows, gemm_rows, native_rows



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(FP8_MODELS), choices=list(FP8_MODELS))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write", action="store_true", help="with --sweep or --cublas: rewrite its tables")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--sweep-replays", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="batch sizes timed per projection")
    parser.add_argument("--chain", action="store_true", help="only qwen3-8b's decode-step chain (see above)")
    parser.add_argument("--cublas", action="store_true", help="only Triton vs cuBLAS FP8 GEMMs (see above)")
    parser.add_argument("--silu-mul", action="store_true", help="only down's SiLU-and-mul, fused or not (see above)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        if args.chain:
            chain(MODELS["qwen3-8b"], gen, args.replays)
            return
        if args.silu_mul:
            silu_mul_quantization("qwen3-8b", gen, args.replays)
            return
        if args.cublas:
            rows = [row for model in args.models for row in cublas(model, gen, args.replays)]
            if args.write:
                rewrite_table(Path(fp8_cublas.__file__), "CUBLAS_FP8_MIN_M", rows)
                print(f"rewrote CUBLAS_FP8_MIN_M in {fp8_cublas.__file__}")
            return
    gemv_rows, gemm_rows, native_rows = ([sum(rows, []) for rows in zip(*(
        projection_tables(model, args, gen) for model in args.models))])
    if args.sweep and args.write:
        rewrite_table(Path(gemv_kernels.__file__), "FP8_CONFIGS", gemv_rows)
        rewrite_table(Path(fp8_kernels.__file__), "FP8_GEMM_CONFIGS", gemm_rows)
        print(f"rewrote FP8_CONFIGS in {gemv_kernels.__file__} and FP8_GEMM_CONFIGS in {fp8_kernels.__file__}")
    if native_rows:
        print("\nNATIVE_FP8_GEMV rows, all models (minisgl/kernels/native.py):\n" + "\n".join(native_rows))


if __name__ == "__main__":
    main()
