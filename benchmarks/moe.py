"""The fused MoE kernel on a GPU at qwen3-30b-a3b shapes (128 experts, top-8, hidden 2048, I_local 768 at
TP 1 and 384 at TP 2): correctness against the torch reference, then times per token count.

    python benchmarks/moe.py           # the configs of the table (minisgl.kernels.fused_moe.CONFIGS)
    python benchmarks/moe.py --sweep   # also a handful of configs per token count; prints the best as
                                       # table rows, ready to paste into CONFIGS

Times are CUDA-graph replays (as the decode step runs), in ms per MoE layer; align is the sort step
alone, route the fused router against torch's softmax + topk (route_torch), torch the reference loop
(small T only: it syncs once per expert). --align-sweep also times align at other pairs per program.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.kernels.fused_moe import MoEConfig, align, fused_experts, pick_config, route_fused
from minisgl.layers.moe import experts_torch, route

EXPERTS, TOP_K, HIDDEN, LAYERS = 128, 8, 2048, 48
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
TORCH_MAX_TOKENS = 16
CHECK_TOKENS = (1, 64, 1024)


def candidates(num_tokens: int) -> list[MoEConfig]:
    """A handful per regime: decode (few rows per expert) wants block_m 16 and many narrow column blocks.
    Each compiles for sm_90 without register spills (a gated 128 x 128 tile needs 8 warps)."""
    if num_tokens <= 64:
        block_ms, tiles = (16,), [(32, 128, 1, 4, 4), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 256, 1, 4, 2),
                                  (128, 128, 1, 4, 3)]
    elif num_tokens <= 512:
        block_ms, tiles = (16, 32, 64), [(64, 64, 8, 4, 3), (64, 128, 8, 4, 3), (128, 64, 8, 4, 3)]
    else:
        block_ms, tiles = (64, 128), [(64, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (128, 32, 8, 8, 4)]
    return [MoEConfig(block_m, *tile) for block_m in block_ms for tile in tiles]


def make_experts(inter: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, device="cuda", generator=gen).div_(HIDDEN**0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, inter, device="cuda", generator=gen).div_(inter**0.5).bfloat16()
    return w13, w2


def make_tokens(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, routing weights, expert ids (random router logits)."""
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = route(torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen), TOP_K, True)
    return x, weights, ids


def check(w13: torch.Tensor, w2: torch.Tensor, gen: torch.Generator) -> None:
    for num_tokens in CHECK_TOKENS:
        x, weights, ids = make_tokens(num_tokens, gen)
        got, want = fused_experts(x, w13, w2, weights, ids), experts_torch(x, w13, w2, weights, ids)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        print(f"check T={num_tokens}: max error / max |ref| = {err:.2e}")
        assert err < 3e-2, "fused_experts disagrees with experts_torch"


def time_fused(args: tuple, config: MoEConfig) -> float:
    return do_bench_cudagraph(lambda: fused_experts(*args, config=config), rep=20)


def bench(w13: torch.Tensor, w2: torch.Tensor, sweep: bool, align_sweep: bool, gen: torch.Generator
          ) -> list[tuple[int, MoEConfig]]:
    print(f"{'tokens':>7} {'fused_ms':>9} {'align_ms':>9} {'route_ms':>9} {'route_torch':>11} {'torch_ms':>9}" + (
        f" {'best_ms':>8}  best config" if sweep else ""))
    best_rows = []
    for num_tokens in TOKENS:
        x, weights, ids = make_tokens(num_tokens, gen)
        args = (x, w13, w2, weights, ids)
        config = pick_config(num_tokens, TOP_K, w13)
        fused = time_fused(args, config)
        aligned = do_bench_cudagraph(lambda: align(ids, EXPERTS, config.block_m), rep=20)
        logits = torch.randn(num_tokens, EXPERTS, device="cuda", generator=gen).bfloat16()
        routed = [do_bench_cudagraph(lambda: fn(logits, TOP_K, True), rep=20) for fn in (route_fused, route)]
        ref = do_bench(lambda: experts_torch(*args), rep=50) if num_tokens <= TORCH_MAX_TOKENS else float("nan")
        line = f"{num_tokens:>7} {fused:>9.4f} {aligned:>9.4f} {routed[0]:>9.4f} {routed[1]:>11.4f} {ref:>9.3f}"
        if align_sweep:
            line += "  align by pairs/program: " + " ".join(
                f"{ppp}={do_bench_cudagraph(lambda: align(ids, EXPERTS, config.block_m, ppp), rep=20):.4f}"
                for ppp in (32, 64, 128, 256, 512))
        if sweep:
            best_ms, best = min(((time_fused(args, c), c) for c in {config, *candidates(num_tokens)}),
                                key=lambda timed: timed[0])
            best_rows.append((num_tokens, best))
            line += f" {best_ms:>8.4f}  {best}"
        print(line, flush=True)
        if num_tokens == 1:
            print(f"{'':>7} batch-1 decode: {fused * LAYERS:.2f} ms per token in the {LAYERS} MoE layers")
    return best_rows


def table_rows(inter: int, rows: list[tuple[int, MoEConfig]]) -> str:
    """CONFIGS entry; a row is dropped when the next token count has the same config."""
    kept = [(tokens, config) for i, (tokens, config) in enumerate(rows)
            if i + 1 == len(rows) or rows[i + 1][1] != config]
    body = "".join(f"        ({tokens}, {config!r}),\n" for tokens, config in kept)
    return f"    ({EXPERTS}, {inter}, {HIDDEN}): (\n{body}    ),"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="try candidate configs, print the best as table rows")
    parser.add_argument("--align-sweep", action="store_true", help="time align at other pairs per program")
    parser.add_argument("--inter", type=int, nargs="+", default=[768, 384], help="I_local (768: TP 1, 384: TP 2)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = []
    with torch.inference_mode():
        for inter in args.inter:
            print(f"\nE={EXPERTS} top_k={TOP_K} H={HIDDEN} I_local={inter}")
            w13, w2 = make_experts(inter, gen)
            check(w13, w2, gen)
            best_rows = bench(w13, w2, args.sweep, args.align_sweep, gen)
            if args.sweep:
                tables.append(table_rows(inter, best_rows))
    if args.sweep:
        print("\n== CONFIGS rows for minisgl/kernels/fused_moe.py")
        print("\n".join(tables))


if __name__ == "__main__":
    main()
