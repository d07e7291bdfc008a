"""Micro-benchmark of one attention layer: the Triton backend against the torch backend on a GPU.

    python benchmarks/attention.py                                  # the default table (bf16, head_dim 128)
    python benchmarks/attention.py --mode decode --batches 1,8 --contexts 4096 --decode-block-n 32
    python benchmarks/attention.py --decode-warps 8 --extend-stages 3 --no-torch   # a quick sweep step
    python benchmarks/attention.py --kv-cache-dtype fp8 --mode decode               # an fp8 pool
    python benchmarks/attention.py --mode mixed --mixed-cases 224x1000+1358+0       # a mixed step, split or not
    python benchmarks/attention.py --extend-sweep --extend-cases 12x640+0,4x512+2048  # extend tiles, the best first

Times `backend.attend` (attention over the pool, into which the step's new K/V were stored by the model's rope
kernel; `prepare` runs once per step and is not included) with triton.testing.do_bench, which flushes L2
between runs. Decode rows report the K/V bytes read per second, extend rows the attention TFLOP/s (causal
pairs only). Mixed rows (decodes, then one prefill chunk) time the Triton backend with the decode rows split
off to the decode kernel (triton_us) and with every row in the extend kernel (unsplit_us): speedup is unsplit
/ split, max_diff between the two. Pages are assigned at random.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

import torch
from triton.testing import do_bench

from minisgl.attention.base import ForwardInput
from minisgl.attention.torch_backend import TorchBackend
from minisgl.attention.triton_backend import ExtendMeta, MixedMeta, TritonBackend
from minisgl.kernels.attention import KernelConfig
from minisgl.kvcache.pool import KVPool, kv_cache_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def random_batch(kv_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device):
    """One layer's pool with exactly the pages the batch needs, in random order, holding the new tokens' K/V
    too, and their q."""
    gen = torch.Generator(device).manual_seed(0)
    counts = [-(-(k + n) // page_size) for k, n in zip(kv_lens, extend_lens)]
    pool = KVPool(1, sum(counts), page_size, kv_heads, head_dim, dtype, device, cache_dtype)
    for cache in (pool.k, pool.v):  # through the model's dtype: torch has no normal_ for fp8
        cache.copy_(torch.empty(cache.shape, dtype=dtype, device=device).normal_(generator=gen))
    page_table = torch.zeros(len(kv_lens), max(counts), dtype=torch.int32, device=device)
    pages = torch.randperm(sum(counts), generator=gen, device=device).int()
    for row, (first, count) in enumerate(zip(torch.tensor(counts).cumsum(0).tolist(), counts)):
        page_table[row, :count] = pages[first - count:first]
    kv, ext = torch.tensor(kv_lens, device=device), torch.tensor(extend_lens, device=device)
    owner = torch.repeat_interleave(torch.arange(len(kv_lens), device=device), ext)
    starts = torch.cumsum(ext, 0) - ext
    tokens = sum(extend_lens)
    positions = kv[owner] + torch.arange(tokens, device=device) - starts[owner]
    out_slots = page_table[owner, positions // page_size].long() * page_size + positions % page_size
    batch = ForwardInput(input_ids=torch.zeros(tokens, dtype=torch.int64, device=device), positions=positions,
                         out_slots=out_slots, rows=torch.arange(len(kv_lens), device=device), kv_lens=kv,
                         extend_lens=ext, seq_lens=kv + ext, last_index=starts + ext - 1, max_extend=max(extend_lens),
                         max_seq_len=max(k + n for k, n in zip(kv_lens, extend_lens)), is_decode=max(extend_lens) == 1)
    q, k, v = [torch.randn(tokens, h, head_dim, generator=gen, device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads)]
    pool.store(0, out_slots, k, v)
    return pool, page_table, batch, q


def time_backend(backend, batch: ForwardInput, q: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Median microseconds of one layer's attention, and its output."""
    meta = backend.prepare(batch)
    run = lambda: backend.attend(0, q, meta)  # noqa: E731
    out = run()
    return 1000 * do_bench(run, return_mode="median"), out


def bench_case(args, config: KernelConfig, mode: str, heads: int, kv_heads: int, batch_size: int, context: int,
               new_tokens: int, page_size: int) -> dict:
    """context = cached tokens before the step; decode feeds 1 new token per request."""
    kv_lens, ext = [context] * batch_size, [new_tokens] * batch_size
    dtype = DTYPES[args.dtype]
    pool, page_table, batch, q = random_batch(kv_lens, ext, heads, kv_heads, args.head_dim, page_size, dtype,
                                                kv_cache_dtype(args.kv_cache_dtype, dtype), torch.device("cuda"))
    triton_us, out = time_backend(TritonBackend(pool, page_table, config), batch, q)
    row = dict(mode=mode, heads=f"{heads}/{kv_heads}", page=page_size, batch=batch_size, context=context,
               new=new_tokens, triton_us=triton_us)
    if mode == "decode":
        kv_bytes = 2 * (context + 1) * batch_size * kv_heads * args.head_dim * pool.k.element_size()
        row["rate"] = f"{kv_bytes / triton_us / 1e3:.0f} GB/s"
    else:  # QK^T and PV, 2 flops per multiply-add, over the visible (causal) pairs
        pairs = batch_size * (new_tokens * context + new_tokens * (new_tokens + 1) // 2)
        row["rate"] = f"{4 * pairs * heads * args.head_dim / triton_us / 1e6:.1f} TFLOP/s"
    if not args.no_torch:
        torch_us, expected = time_backend(TorchBackend(pool, page_table), batch, q)
        row.update(torch_us=torch_us, speedup=torch_us / triton_us,
                   max_diff=(out.float() - expected.float()).abs().max().item())
    del pool, page_table, batch, q
    torch.cuda.empty_cache()
    return row


def bench_mixed(args, config: KernelConfig, heads: int, kv_heads: int, decodes: int, context: int, chunk: int,
                prefix: int, page_size: int) -> dict:
    """`decodes` requests of `context` cached tokens decode beside one chunk of `chunk` new tokens after `prefix`
    cached ones, as the scheduler orders a mixed step: with the decode rows split off, then without."""
    kv_lens, ext = [context] * decodes + [prefix], [1] * decodes + [chunk]
    dtype = DTYPES[args.dtype]
    pool, page_table, batch, q = random_batch(kv_lens, ext, heads, kv_heads, args.head_dim, page_size, dtype,
                                                kv_cache_dtype(args.kv_cache_dtype, dtype), torch.device("cuda"))
    batch = dataclasses.replace(batch, decode_rows=decodes, decode_kv_tokens=decodes * context)
    timed = {}
    for split_bytes, kind in ((0, MixedMeta), (1 << 62, ExtendMeta)):
        backend = TritonBackend(pool, page_table, config, mixed_split_kv_bytes=split_bytes)
        assert isinstance(backend.prepare(batch), kind)
        timed[kind] = time_backend(backend, batch, q)
    (split_us, out), (unsplit_us, expected) = timed[MixedMeta], timed[ExtendMeta]
    row = dict(mode="mixed", heads=f"{heads}/{kv_heads}", page=page_size, batch=decodes, context=context,
               new=chunk, triton_us=split_us, unsplit_us=unsplit_us, speedup=unsplit_us / split_us,
               max_diff=(out.float() - expected.float()).abs().max().item())
    del pool, page_table, batch, q
    torch.cuda.empty_cache()
    return row


COLUMNS = {  # name: (width, format of a number)
    "mode": (6, ""), "heads": (5, ""), "page": (4, ""), "batch": (5, ""), "context": (7, ""), "new": (5, ""),
    "triton_us": (10, ".1f"), "torch_us": (10, ".1f"), "unsplit_us": (10, ".1f"),
    "speedup": (7, ".2f"), "rate": (15, ""), "max_diff": (8, ".1e"),
}


def print_row(row: dict) -> None:
    """One line per case as soon as it is measured (fixed widths, so a crash later keeps what was printed)."""
    cells = [format(row[c], fmt) if c in row else "-" for c, (_, fmt) in COLUMNS.items()]
    print("  ".join(cell.rjust(width) for cell, (width, _) in zip(cells, COLUMNS.values())), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["all", "decode", "extend", "mixed"], default="all")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the pool's: auto = --dtype")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-configs", default="16/8,32/8", help="heads/kv_heads list (qwen3-0.6b, qwen3-8b)")
    p.add_argument("--page-sizes", type=int_list, default=[1])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32, 128, 256], help="decode batch sizes")
    p.add_argument("--contexts", type=int_list, default=[1024, 4096], help="decode context lengths")
    p.add_argument("--extend-cases", default="1x1024+0,1x4096+0,4x512+2048,16x256+1024,32x64+3072",
                   help="BATCHxNEW+PREFIX list: requests x new tokens after a cached prefix")
    p.add_argument("--mixed-cases", default="224x1000+1358+0,64x800+1024+0,32x2000+512+1024",
                   help="DECODESxCONTEXT+CHUNK+PREFIX list: decodes of CONTEXT cached tokens beside one chunk")
    p.add_argument("--no-torch", action="store_true", help="time the Triton backend only")
    p.add_argument("--extend-sweep", action="store_true", help="rank the extend kernel's tiles (EXTEND_SWEEP)")
    defaults = KernelConfig()
    for field in dataclasses.fields(KernelConfig):
        flag = "--" + field.name.replace("_", "-")
        p.add_argument(flag, type=int, default=getattr(defaults, field.name), help=f"KernelConfig.{field.name}")
    return p.parse_args()


EXTEND_SWEEP = dict(extend_block_m=(64, 128), extend_block_n=(64, 128), extend_warps=(4, 8),
                    extend_stages=(2, 3, 4))


def extend_sweep(args, base: KernelConfig, heads_list: list[tuple[int, int]]) -> None:
    """Every EXTEND_SWEEP tile on every (head config, extend case); configs ranked by the geometric mean of their
    time over the default's, so one table row serves the whole mix of cases."""
    cases = [(heads, kv_heads, case) for heads, kv_heads in heads_list for case in args.extend_cases.split(",")]
    times: dict[KernelConfig, list[float]] = {}
    for values in itertools.product(*EXTEND_SWEEP.values()):
        config = dataclasses.replace(base, **dict(zip(EXTEND_SWEEP, values)))
        try:
            times[config] = [extend_us(args, config, heads, kv_heads, case) for heads, kv_heads, case in cases]
        except Exception as exc:  # a tile too large for shared memory or registers
            print(f"skipped {values}: {type(exc).__name__}")
    default = times[base]
    ratio = {config: math.prod(t / d for t, d in zip(us, default)) ** (1 / len(us)) for config, us in times.items()}
    ranked = sorted(times, key=ratio.get)
    print("geomean vs default  block_m block_n warps stages  " + "  ".join(f"{h}/{kv} {c}" for h, kv, c in cases))
    for config in ranked[:12] + [base]:
        us, knobs = times[config], [getattr(config, name) for name in EXTEND_SWEEP]
        print(f"{ratio[config]:19.3f}  {knobs[0]:7d} {knobs[1]:7d} {knobs[2]:5d} {knobs[3]:6d}  "
              + "  ".join(f"{t:.1f}" for t in us))


def extend_us(args, config: KernelConfig, heads: int, kv_heads: int, case: str) -> float:
    batch_size, new, prefix = extend_case(case)
    return bench_case(args, config, "extend", heads, kv_heads, batch_size, prefix, new, args.page_sizes[0])[
        "triton_us"]


def extend_case(case: str) -> tuple[int, int, int]:
    """'BATCHxNEW+PREFIX' -> (requests, new tokens each, cached tokens before them)."""
    shape, prefix = case.split("+")
    batch_size, new = (int(x) for x in shape.split("x"))
    return batch_size, new, int(prefix)


def main() -> None:
    args = parse_args()
    config = KernelConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(KernelConfig)})
    heads_list = [tuple(int(x) for x in hc.split("/")) for hc in args.head_configs.split(",")]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  kv {args.kv_cache_dtype}  head_dim {args.head_dim}  {config}")
    if args.extend_sweep:
        extend_sweep(argparse.Namespace(**{**vars(args), "no_torch": True}), config, heads_list)
        return
    print("  ".join(c.rjust(width) for c, (width, _) in COLUMNS.items()))
    for page_size in args.page_sizes:
        for heads, kv_heads in heads_list:
            if args.mode in ("all", "decode"):
                for context in args.contexts:
                    for batch_size in args.batches:
                        print_row(bench_case(args, config, "decode", heads, kv_heads, batch_size, context, 1,
                                             page_size))
            if args.mode in ("all", "extend"):
                for case in args.extend_cases.split(","):
                    batch_size, new, prefix = extend_case(case)
                    print_row(bench_case(args, config, "extend", heads, kv_heads, batch_size, prefix, new,
                                         page_size))
            if args.mode in ("all", "mixed"):
                for case in args.mixed_cases.split(","):
                    shape, chunk, prefix = case.split("+")
                    decodes, context = (int(x) for x in shape.split("x"))
                    print_row(bench_mixed(args, config, heads, kv_heads, decodes, context, int(chunk), int(prefix),
                                          page_size))


if __name__ == "__main__":
    main()
