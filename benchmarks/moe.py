"""The fused MoE kernel on a GPU at qwen3-30b-a3b shapes (128 experts, top-8, hidden 2048, I_local 768 at
TP 1 and 384 at TP 2): correctness against the torch reference, then times per token count.

    python benchmarks/moe.py                   # the configs of the table (minisgl.kernels.fused_moe.CONFIGS)
    python benchmarks/moe.py --sweep           # also a handful of configs per token count; prints the best
                                               # as table rows, ready to paste into CONFIGS
    python benchmarks/moe.py --fp8             # e4m3 experts with 128 x 128 block scales (Qwen3-30B-A3B-FP8's
                                               # layout), their table FP8_CONFIGS; bf16's time beside them
    python benchmarks/moe.py --fp8 --sweep --write --inter 768   # FP8 candidates (x quantized by its own
                                               # launch or in the tiles); rewrites FP8_CONFIGS' rows for
                                               # the I_local swept (--write without --fp8: CONFIGS)
    python benchmarks/moe.py --fp8 --inter 768 --small-sweep --tokens 1 2 4 8 16  # tiles of the few-token GEMVs

Up to SMALL_TOKENS tokens the few-token path (`minisgl.kernels.moe_gemv`: two GEMV launches, no align) is
timed beside the fused MoE (small_ms, and small / fused); SparseMoE takes it up to SMALL_MOE_MAX_TOKENS.

Times are CUDA-graph replays (as the decode step runs), in ms per MoE layer; consecutive calls take other
routings of the same token count (ROUTINGS of them), so that a small batch's experts are not still in the L2
cache from the call before (a model's layers each read their own). GB/s counts the bytes of the experts a
call reads (weights and scales). align is the sort step alone, route the fused router against torch's
softmax + topk (route_torch), torch the reference loop (small T only: it syncs once per expert).

    python benchmarks/moe.py --align-sweep [--align-baseline OLD.py]

times only the align at 1-16,384 tokens x top-8 (block_m from FP8_CONFIGS at I_local 768,
as W1 of qwen3-30b-a3b FP8 runs): align as dispatched, forced to one launch and to the counted two-launch path
at several pairs per program, the `align` of another copy of fused_moe.py beside it (e.g. `git show
<commit>:minisgl/kernels/fused_moe.py > OLD.py`); a markdown table last.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import sys
from pathlib import Path

import torch
from fp8 import rewrite_table
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.kernels import fused_moe
from minisgl.kernels.fused_moe import MoEConfig, align, fused_experts, pick_config, route_fused
from minisgl.kernels.moe_gemv import MoeGemvConfig, moe_gemv
from minisgl.layers.fp8 import quantize_weight
from minisgl.layers.moe import experts_torch, route
from minisgl.quantization import Fp8Config

EXPERTS, TOP_K, HIDDEN, LAYERS = 128, 8, 2048, 48
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
TORCH_MAX_TOKENS = 16
CHECK_TOKENS = (1, 64, 1024)
CHECK_MAX_TOKENS = 1024  # the sweep checks its winner against the reference up to here
ROUTINGS = 8
SMALL_TOKENS = 8  # the few-token GEMVs are timed up to here
BLOCK = Fp8Config(block=(128, 128))


class Experts:
    """One layer's experts: bf16, or e4m3 with their block scales (`fp8`)."""

    def __init__(self, inter: int, fp8: bool, gen: torch.Generator):
        self.w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, device="cuda", generator=gen).div_(HIDDEN**0.5)
        self.w2 = torch.randn(EXPERTS, HIDDEN, inter, device="cuda", generator=gen).div_(inter**0.5)
        self.fp8, self.scales = (BLOCK if fp8 else None), None
        if fp8:  # as the loader lays out Qwen3-30B-A3B-FP8: e4m3 [E, rows, cols], scales [E, rows/128, cols/128]
            (self.w13, s13), (self.w2, s2) = quantize_weight(self.w13, BLOCK), quantize_weight(self.w2, BLOCK)
            self.scales = (s13, s2)
        else:
            self.w13, self.w2 = self.w13.bfloat16(), self.w2.bfloat16()

    def bytes_per_expert(self) -> int:
        tensors = (self.w13, self.w2) + (self.scales or ())
        return sum(t.nbytes for t in tensors) // EXPERTS

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            config: MoEConfig | MoeGemvConfig | None = None, reference: bool = False) -> torch.Tensor:
        """fused_experts with a MoEConfig (or the table's), moe_gemv with a MoeGemvConfig, or the reference."""
        kernel = moe_gemv if isinstance(config, MoeGemvConfig) else fused_experts
        fn = experts_torch if reference else lambda *args, **kw: kernel(*args, config=config, **kw)
        return fn(x, self.w13, self.w2, weights, ids, scales=self.scales, fp8=self.fp8)


def candidates(num_tokens: int, fp8: bool) -> list[MoEConfig]:
    """A handful per regime: decode (few rows per expert) wants block_m 16 and many narrow column blocks.
    Each compiles for sm_90 without register spills (a gated 128 x 128 tile needs 8 warps). FP8: BLOCK_K is
    the 128-column scale group; the smallest batches also try quantizing x in the tiles (no extra launches).
    Its per-group scaling keeps each dot's product beside the accumulators: 64 x 128 tiles take 255
    registers with 4 warps, 176 with 8, and 128 x 128 ones spill a little even with 8 (ptxas, sm_90a)."""
    if fp8 and num_tokens <= 64:
        tiles = [(16, 32, 1, 4, 4), (16, 64, 1, 4, 3), (16, 64, 1, 4, 4), (16, 128, 1, 4, 3), (16, 128, 1, 4, 4),
                 (16, 128, 1, 4, 5)]
        return [MoEConfig(m, n, 128, g, w, s, in_tile) for m, n, g, w, s in tiles for in_tile in (False, True)] + [
            MoEConfig(16, 256, 128, 1, 8, 3)]
    if fp8:
        tiles = [(m, n, 8, 4, s) for m in ((16, 32, 64) if num_tokens <= 512 else (64,)) for n in (64, 128)
                 for s in (3, 4)]
        tiles += [(64, 128, 8, 8, 4)] + [(128, n, 8, 8, s) for n in (64, 128) for s in (3, 4)] \
            if num_tokens > 512 else []
        return [MoEConfig(m, n, 128, g, w, s) for m, n, g, w, s in tiles]
    if num_tokens <= 64:
        block_ms, tiles = (16,), [(32, 128, 1, 4, 4), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 256, 1, 4, 2),
                                  (128, 128, 1, 4, 3)]
    elif num_tokens <= 512:
        block_ms, tiles = (16, 32, 64), [(64, 64, 8, 4, 3), (64, 128, 8, 4, 3), (128, 64, 8, 4, 3)]
    else:
        block_ms, tiles = (64, 128), [(64, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (128, 32, 8, 8, 4)]
    return [MoEConfig(block_m, *tile) for block_m in block_ms for tile in tiles]


def small_candidates(fp8: bool) -> list[MoeGemvConfig]:
    """Column tiles of the two GEMVs, the down GEMV's slot groups (at one token it has H / down_block_n *
    down_split programs); BLOCK_K is the scale group for FP8, 128 or 256 for bf16. Tiles
    that spill registers on sm_90 (64-row down tiles; 64-row bf16 gate/up tiles) are left out; num_stages
    changes nothing (ptxas output identical: the weight tiles go straight to registers, not through shared
    memory)."""
    downs = ((16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8))
    ups, block_ks = ((16, 32, 64), (128,)) if fp8 else ((16, 32), (128, 256))
    return [MoeGemvConfig(up, down, split, block_k) for up in ups for down, split in downs for block_k in block_ks]


def make_tokens(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, routing weights, expert ids (random router logits)."""
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = route(torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen), TOP_K, True)
    return x, weights, ids


def error(experts: Experts, tokens: tuple, config: MoEConfig | None = None) -> float:
    """max |fused - reference| / max |reference|."""
    got, want = experts.run(*tokens, config), experts.run(*tokens, reference=True)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check(experts: Experts, gen: torch.Generator) -> None:
    for num_tokens in CHECK_TOKENS:
        err = error(experts, make_tokens(num_tokens, gen))
        print(f"check T={num_tokens}: max error / max |ref| = {err:.2e}")
        assert err < 3e-2, "fused_experts disagrees with experts_torch"
    for num_tokens in (1, SMALL_TOKENS):
        err = error(experts, make_tokens(num_tokens, gen), MoeGemvConfig())
        print(f"check moe_gemv T={num_tokens}: max error / max |ref| = {err:.2e}")
        assert err < 3e-2, "moe_gemv disagrees with experts_torch"


def time_fused(experts: Experts, routings: list[tuple], config: MoEConfig | MoeGemvConfig) -> float:
    cycle = itertools.cycle(routings)
    return do_bench_cudagraph(lambda: experts.run(*next(cycle), config), rep=20)


def bench(experts: Experts, baseline: Experts | None, sweep: bool, small_sweep: bool, tokens: list[int],
          gen: torch.Generator) -> tuple[list[tuple[int, MoEConfig]], list[tuple[int, float, float, float, float]]]:
    """Times per token count; `baseline` (bf16 experts, for --fp8) is timed beside with its own table.
    Returns the sweep's best config per token count, and (tokens, baseline ms, table ms, best ms, few-token
    GEMVs ms) rows."""
    fp8 = experts.fp8 is not None
    print(f"{'tokens':>7} {'fused_ms':>9} {'GB/s':>6}" + (f" {'bf16_ms':>8} {'ratio':>6}" if baseline else "")
          + f" {'small_ms':>9} {'small/fused':>11}" + (f" {'bf16_small':>10}" if baseline else "")
          + f" {'align_ms':>9} {'route_ms':>9} {'route_torch':>11} {'torch_ms':>9}"
          + (f" {'best_ms':>8}  best config" if sweep else ""))
    best_rows, summary = [], []
    for num_tokens in tokens:
        routings = [make_tokens(num_tokens, gen) for _ in range(ROUTINGS)]
        x, weights, ids = routings[0]
        config = pick_config(num_tokens, TOP_K, experts.w13)
        fused = time_fused(experts, routings, config)
        read = sum(r[2].unique().numel() for r in routings) / ROUTINGS * experts.bytes_per_expert()
        line = f"{num_tokens:>7} {fused:>9.4f} {read / fused / 1e6:>6.0f}"
        base = best_ms = small = float("nan")
        if baseline:
            base = time_fused(baseline, routings, pick_config(num_tokens, TOP_K, baseline.w13))
            line += f" {base:>8.4f} {fused / base:>6.2f}"
        if num_tokens <= SMALL_TOKENS:
            small = time_fused(experts, routings, MoeGemvConfig())
            line += f" {small:>9.4f} {small / fused:>11.2f}"
            if baseline:
                line += f" {time_fused(baseline, routings, MoeGemvConfig()):>10.4f}"
        else:
            line += f" {'':>9} {'':>11}" + (f" {'':>10}" if baseline else "")
        aligned = do_bench_cudagraph(lambda: align(ids, EXPERTS, config.block_m), rep=20)
        logits = torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen).bfloat16()
        routed = [do_bench_cudagraph(lambda: fn(logits, TOP_K, True), rep=20) for fn in (route_fused, route)]
        ref = (do_bench(lambda: experts.run(x, weights, ids, reference=True), rep=50)
               if num_tokens <= TORCH_MAX_TOKENS else float("nan"))
        line += f" {aligned:>9.4f} {routed[0]:>9.4f} {routed[1]:>11.4f} {ref:>9.3f}"
        if sweep:
            tried = {config, *candidates(num_tokens, fp8)}
            best_ms, best = min(((time_fused(experts, routings, c), c) for c in tried), key=lambda timed: timed[0])
            if num_tokens <= CHECK_MAX_TOKENS:
                assert error(experts, routings[0], best) < 3e-2, f"{best} disagrees with experts_torch"
            best_rows.append((num_tokens, best))
            line += f" {best_ms:>8.4f}  {best}"
        print(line, flush=True)
        if small_sweep and num_tokens <= SMALL_TOKENS:
            timed = sorted(((time_fused(experts, routings, c), c) for c in small_candidates(fp8)), key=lambda t: t[0])
            for ms, c in timed[:3]:
                assert error(experts, routings[0], c) < 3e-2, f"{c} disagrees with experts_torch"
                print(f"{'':>7} small sweep: {ms:.4f} ms {c}", flush=True)
        summary.append((num_tokens, base, fused, best_ms, small))
        if num_tokens == 1:
            print(f"{'':>7} batch-1 decode: {fused * LAYERS:.2f} ms per token in the {LAYERS} MoE layers "
                  f"(few-token GEMVs: {small * LAYERS:.2f})")
    return best_rows, summary


ALIGN_TOKENS = [1, 8, 16, 32, 64, 128, 200, 256, 512, 1024, 2048, 4096, 16384]
ALIGN_SPLITS = {True: (32, 64, 128), False: (64, 128, 512)}  # pairs per program, one launch / counted


def load_align(path: str):
    """`align` of another copy of fused_moe.py (an older commit's), as its own module."""
    spec = importlib.util.spec_from_file_location("fused_moe_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.align


def layout(aligned: tuple[torch.Tensor, ...], block_m: int) -> tuple[list[int], list[int]]:
    """The rows in use of an align's sorted_ids, and their blocks' experts."""
    sorted_ids, block_expert, num_padded = aligned
    rows = num_padded.item()
    return sorted_ids[:rows].tolist(), block_expert[:rows // block_m].tolist()


def align_sweep(gen: torch.Generator, baseline_path: str | None) -> None:
    """Microseconds (CUDA-graph replays) of align per token count; see the module doc.
    Every align variant must give the dispatched one's layout (compiled, at full size) before it is timed."""
    w13 = torch.empty(EXPERTS, 2 * 768, HIDDEN, dtype=torch.float8_e4m3fn, device="meta")
    baseline = load_align(baseline_path) if baseline_path else None
    print(f"\nus per call, E={EXPERTS} top_k={TOP_K} H={HIDDEN}, block_m of FP8_CONFIGS (I_local 768); "
          "ratio: align / baseline")
    rows, names = [], []
    for num_tokens in ALIGN_TOKENS:
        ids = route_fused(torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen), TOP_K, True)[1]
        block_m = pick_config(num_tokens, TOP_K, w13).block_m
        variants = {"align": functools.partial(align, ids, EXPERTS, block_m)}
        if baseline:
            variants["baseline"] = functools.partial(baseline, ids, EXPERTS, block_m)
        for one, ppp in ((one, ppp) for one, splits in ALIGN_SPLITS.items() for ppp in splits):
            variants[f"{'one' if one else 'counted'}/{ppp}"] = functools.partial(align, ids, EXPERTS, block_m, ppp, one)
        want = layout(variants["align"](), block_m)
        for name, fn in variants.items():
            assert layout(fn(), block_m) == want, f"{name} disagrees with align at {num_tokens} tokens"
        times = {name: do_bench_cudagraph(fn, rep=20) * 1000 for name, fn in variants.items()}
        if baseline:
            times["ratio"] = times["align"] / times["baseline"]
        if not names:
            names = list(times)
            print(f"{'tokens':>7} {'block_m':>7} " + " ".join(f"{name:>11}" for name in names))
        print(f"{num_tokens:>7} {block_m:>7} " + " ".join(f"{times[name]:>11.2f}" for name in names), flush=True)
        rows.append((num_tokens, times))
    print(f"\n== align, us per call, {torch.cuda.get_device_name()}")
    print("| tokens | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for num_tokens, times in rows:
        print(f"| {num_tokens} | " + " | ".join(f"{times[name]:.2f}" for name in names) + " |")


def table_entry(key: tuple[int, int, int], rows: list[tuple[int, MoEConfig]]) -> str:
    """A CONFIGS / FP8_CONFIGS entry; a row is dropped when the next token count has the same config."""
    kept = [(tokens, config) for i, (tokens, config) in enumerate(rows)
            if i + 1 == len(rows) or rows[i + 1][1] != config]
    body = "".join(f"        ({tokens}, {config!r}),\n" for tokens, config in kept)
    return f"    {key}: (\n{body}    ),"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp8", action="store_true", help="e4m3 experts, 128 x 128 block scales")
    parser.add_argument("--sweep", action="store_true", help="try candidate configs, print the best as table rows")
    parser.add_argument("--write", action="store_true", help="with --sweep: rewrite the table's swept entries")
    parser.add_argument("--align-sweep", action="store_true",
                        help="time only align (at several splits)")
    parser.add_argument("--align-baseline", metavar="FILE", help="with --align-sweep: a fused_moe.py to time beside")
    parser.add_argument("--small-sweep", action="store_true", help="try tiles of the few-token GEMVs (T <= 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts to time")
    parser.add_argument("--inter", type=int, nargs="+", default=[768, 384], help="I_local (768: TP 1, 384: TP 2)")
    args = parser.parse_args()
    name = "FP8_CONFIGS" if args.fp8 else "CONFIGS"
    print(torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.align_sweep:
        with torch.inference_mode():
            align_sweep(gen, args.align_baseline)
        return
    swept: dict[tuple[int, int, int], list[tuple[int, MoEConfig]]] = {}
    summary: list[tuple[int, int, float, float, float, float]] = []
    with torch.inference_mode():
        for inter in args.inter:
            print(f"\nE={EXPERTS} top_k={TOP_K} H={HIDDEN} I_local={inter} " + ("FP8 (e4m3, 128 x 128)" if args.fp8
                                                                                  else "bf16"))
            experts = Experts(inter, args.fp8, gen)
            check(experts, gen)
            baseline = Experts(inter, False, gen) if args.fp8 else None
            best_rows, rows = bench(experts, baseline, args.sweep, args.small_sweep, args.tokens, gen)
            summary += [(inter, *row) for row in rows]
            if args.sweep:
                swept[(EXPERTS, inter, HIDDEN)] = best_rows
            del experts, baseline
    if args.sweep:
        table = {**getattr(fused_moe, name), **swept}  # entries not swept stay as they are
        entries = [table_entry(key, swept[key]) if key in swept else table_entry(key, list(rows))
                   for key, rows in table.items()]
        print(f"\n== {name} rows for minisgl/kernels/fused_moe.py")
        print("\n".join(entries))
        if args.write:
            rewrite_table(Path(fused_moe.__file__), name, entries)
            print(f"rewrote {name} in {fused_moe.__file__}")
    if args.fp8:
        print(f"\n== ms per MoE layer, {torch.cuda.get_device_name()} (FP8: FP8_CONFIGS as run; best: the sweep's)")
        print("| I_local | tokens | bf16 | FP8 | FP8 best | FP8 few-token | FP8 / bf16 | best / bf16 "
              "| few-token / FP8 |\n|---|---|---|---|---|---|---|---|---|")
        for inter, tokens, base, fused, best, small in summary:
            print(f"| {inter} | {tokens} | {base:.4f} | {fused:.4f} | {best:.4f} | {small:.4f} | {fused / base:.2f} "
                  f"| {best / base:.2f} | {small / fused:.2f} |")

if __name__ == "__main__":
    main()
