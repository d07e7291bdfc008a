"""Where a decode step's time goes, on the GPU and on the CPU (and a whole workload's, or a prompt burst's).

    python benchmarks/profile_decode.py --config .bench_models/qwen3-0.6b.json --batch 1 256 --context 800
    python benchmarks/profile_decode.py --config .bench_models/qwen3-0.6b.json --workload w3
    python benchmarks/profile_decode.py --config .bench_models/qwen3-8b.json --workload prefill --batch 64
    python benchmarks/profile_decode.py --config .bench_models/qwen3-30b-a3b.json --workload w1

decode: for each batch size, the top kernels of a few decode steps run eagerly (so the profiler sees
every kernel; a kernel takes the same time inside a CUDA graph), then the wall time per step of the
real engine (CUDA graphs, overlap) over the same steps: the gap between the two is host overhead.
w3: the shared-prefix workload of offline.py under cProfile (host hot spots) and the kernel profiler.
w1: the throughput workload of offline.py under the kernel profiler alone (kernels in CUDA graphs included):
where a whole W1 run spends its GPU time, and how much of the wall time the GPU is busy.
prefill: a burst of prompts as the online benchmark sends them (`--batch` prompts of 256-1,024 random ids,
steps of `--budget` tokens), with and without CUDA graphs: the wall time per prompt token (what bounds a
burst's last first token) and the top kernels of the eager run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch
from offline import minisgl_generate, model_dir, w1, w3

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.messages import AddReq


def top_kernels(prof: torch.profiler.profile, per: float, top: int, unit: str = "step") -> None:
    """The kernels' device time per `unit` (`per` units were profiled), in all and for the `top` kernels."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    print(f"{total / per / 1000:.3f} ms of kernels per {unit}")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"{e.device_time_total / per:9.1f} us/{unit} {e.count / per:6.1f}x  {e.key[:90]}")


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int, profile: bool, top: int) -> float:
    """Prefill the prompts, then time (and maybe profile) `steps` decode ticks; ms per tick."""
    sched = llm.scheduler
    params = SamplingParams(temperature=0.6, max_tokens=steps + 4, ignore_eos=True)
    sched.tick([AddReq(Req(10**6 + i, p, params, seed=i)) for i, p in enumerate(prompts)])
    while sched.waiting or any(r.device_len - r.kv_len > 1 for r in sched.running):  # until all decode
        sched.tick([])
    sched.tick([])
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] if profile else []
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            sched.tick([])
        torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - start) / steps
    if profile:
        top_kernels(prof, steps, top)
    while sched.has_work:
        sched.tick([])
    sched.take_outputs()
    return ms


def prefill_burst(llm: LLM, prompts: list[list[int]], profile: bool, top: int) -> float:
    """Prefill `prompts` (one output token each) from an idle engine, maybe under the kernel profiler; us per
    prompt token, wall time."""
    sched, params = llm.scheduler, SamplingParams(max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] if profile else []
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        sched.tick([AddReq(Req(10**6 + i, p, params, seed=i)) for i, p in enumerate(prompts)])
        while sched.has_work:
            sched.tick([])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    sched.take_outputs()
    tokens = sum(map(len, prompts))
    if profile:
        top_kernels(prof, tokens / 1000, top, unit="1k tokens")
    return 1e6 * seconds / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--workload", choices=["decode", "w1", "w3", "prefill"], default="decode")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--budget", type=int, default=8192, help="prefill: tokens per step (the server's default)")
    args = parser.parse_args()
    common = dict(dtype="bfloat16", dummy_weights=True, max_seq_len=4096, max_prefill_tokens=16384)
    if args.workload == "w1":
        llm = LLM(model_dir(args.config), max_running_requests=256, **common)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            print(w1(minisgl_generate(llm)))
        top_kernels(prof, 1, args.top, unit="run")
        return
    if args.workload == "w3":
        llm = LLM(model_dir(args.config), **common)
        w3(minisgl_generate(llm))  # warm-up: compiles, captures, caches
        host = cProfile.Profile()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            host.enable()
            print(w3(minisgl_generate(llm)))
            host.disable()
        top_kernels(prof, 1, args.top, unit="run")
        pstats.Stats(host).sort_stats("tottime").print_stats(args.top)
        return
    if args.workload == "prefill":
        rng = random.Random(0)
        lengths = [rng.randint(256, 1024) for _ in range(max(args.batch))]
        warm_up, timed, profiled = ([[rng.randint(0, 10000) for _ in range(n)] for n in lengths] for _ in range(3))
        for pieces in (False, True):  # no CUDA graphs of any kind, then the engine's defaults
            llm = LLM(model_dir(args.config), max_running_requests=len(lengths), memory_ratio=0.8,
                      cuda_graph_max_bs=256 if pieces else 0, **{**common, "max_prefill_tokens": args.budget})
            prefill_burst(llm, warm_up, False, 0)  # compiles every step size met (new ids each run: no cache hits)
            kind = "eager" if not pieces else f"whole-step graphs (kept to {llm.engine.whole.max_tokens} tokens)"
            print(f"\n== {len(lengths)} prompts, {sum(lengths)} tokens, steps of {args.budget}, {kind}:")
            print(f"{prefill_burst(llm, timed, False, 0):.2f} us per prompt token (wall)")
            if not pieces:  # the kernels are the same either way; the profiler's own cost stays out of the timing
                prefill_burst(llm, profiled, True, args.top)
            llm.shutdown()
        return
    eager = LLM(model_dir(args.config), cuda_graph_max_bs=0, overlap_schedule=False, memory_ratio=0.4, **common)
    fast = LLM(model_dir(args.config), memory_ratio=0.8, **common)
    rng = random.Random(0)
    for bs in args.batch:
        prompts = [[rng.randint(0, 10000) for _ in range(args.context)] for _ in range(bs)]
        print(f"\n== batch {bs}, context {args.context}, eager:")
        eager_ms = decode_steps(eager, prompts, args.steps, True, args.top)
        decode_steps(fast, prompts, args.steps, False, 0)  # warm-up
        print(f"wall per step: eager {eager_ms:.3f} ms, CUDA graphs + overlap "
              f"{decode_steps(fast, prompts, args.steps, False, 0):.3f} ms")


if __name__ == "__main__":
    main()
