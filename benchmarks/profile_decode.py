"""Where a decode step's GPU time goes: the top kernels of a few decode steps, per batch size.

    python benchmarks/profile_decode.py --config .bench_models/qwen3-0.6b.json --batch 1 256

Eager (no CUDA graphs), so the profiler sees every kernel; a kernel's time is the same in a graph.
"""

from __future__ import annotations

import argparse
import random

import torch
from offline import model_dir

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.scheduler import AddReq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    llm = LLM(model_dir(args.config), dtype="bfloat16", dummy_weights=True, max_seq_len=4096,
              cuda_graph_max_bs=0, overlap_schedule=False)
    rng = random.Random(0)
    for bs in args.batch:
        prompts = [[rng.randint(0, 10000) for _ in range(args.context)] for _ in range(bs)]
        params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 1, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        sched = llm.scheduler
        sched.tick([AddReq(Req(10**6 + i, p, params, seed=i)) for i, p in enumerate(prompts)])  # prefill
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            while sched.has_work:
                sched.tick([])
            torch.cuda.synchronize()
        sched.finished.clear()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        print(f"\n== batch {bs}, context {args.context}: {total / args.steps / 1000:.3f} ms of kernels per step")
        for e in sorted(events, key=lambda e: -e.device_time_total)[: args.top]:
            print(f"{e.device_time_total / args.steps:9.1f} us/step {e.count // args.steps:5d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
