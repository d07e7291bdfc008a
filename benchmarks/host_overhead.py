"""The scheduler's host time per decode step at large batches, on the CPU, apart from the model's compute.

    python benchmarks/host_overhead.py                  # batch 64 and 256, 200 decode steps each
    python benchmarks/host_overhead.py --batch 256 --profile   # and cProfile's top functions by own time

With overlap scheduling the host's work for a step hides under the device's only while it is shorter: a
qwen3-0.6b decode step at batch 256 takes a few ms on an H200. This script runs a tiny random model on the
CPU with every request decoding (short prompts, sampling at temperature 0.6 as W1 does, page size 1 as the
server's default) and times, per step, the parts of `Scheduler.step`:

- batch: `_next_batch` (decode batch, page reservations, page-table flush);
- forward prep: `Engine.forward` less the model (the inputs' host->device tensors);
- sample prep: `Engine.sample` less `Sampler.sample` (rows, positions, host copies of the tokens);
- commit: `_commit` (reading the tokens, appending them, stop checks);
- host total: the step less the model and `Sampler.sample`, i.e. all of the above plus the glue.

The model and the sampler's tensor work are excluded: on a GPU they are kernels on the device (the model is
one CUDA-graph replay per step; the sampler launches a few dozen kernels, whose launch cost this does not
measure; nor do the small tensor ops counted in the two preps, kernels there too). Figures are the median
and the fastest step, in milliseconds: the machine's load moves the medians, the fastest is the cost alone.
Torch runs on one thread (`--threads`): on a small shared machine, OpenMP workers spinning after the model's
ops slow the host's Python unpredictably.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time
from typing import Callable

import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.messages import AddReq
from minisgl.tools.tiny_model import make_tiny_model

PARTS = ("step", "batch", "forward", "hidden", "logits", "sample", "sampler", "commit")


def timed(record: list[float], fn: Callable) -> Callable:
    """fn, appending each call's wall time to `record`."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)
    return wrapper


def decoding_llm(model: str, batch: int) -> LLM:
    """An engine whose `batch` requests have all finished their prefill and decode at every step from now on."""
    llm = LLM(model, device="cpu", dtype="float32", num_pages=batch * 1100 + 64, max_running_requests=batch)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True)
    reqs = [Req(i, [rng.randrange(3, 400) for _ in range(32)], params, seed=i) for i in range(batch)]
    scheduler = llm.scheduler
    scheduler.sync_and_apply([AddReq(r) for r in reqs])
    while scheduler.unread_step is None or not scheduler.unread_step.batch.is_decode:
        scheduler.step()
    return llm


def instrument(llm: LLM) -> dict[str, list[float]]:
    """Time each part of the engine's steps from now on: part -> one wall time per call."""
    scheduler, engine = llm.scheduler, llm.engine
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    scheduler.step = timed(times["step"], scheduler.step)
    scheduler._next_batch = timed(times["batch"], scheduler._next_batch)
    scheduler._commit = timed(times["commit"], scheduler._commit)
    engine.forward = timed(times["forward"], engine.forward)
    engine._hidden = timed(times["hidden"], engine._hidden)  # the model's forward, eagerly (no graphs on a CPU)
    engine.model.compute_logits = timed(times["logits"], engine.model.compute_logits)
    engine.sample = timed(times["sample"], engine.sample)
    engine.sampler.sample = timed(times["sampler"], engine.sampler.sample)
    return times


def measure(llm: LLM, times: dict[str, list[float]], steps: int) -> dict[str, tuple[float, float]]:
    """(median, fastest) milliseconds per step of each part over `steps` decode steps, the host's share derived."""
    for record in times.values():
        record.clear()
    for _ in range(steps):
        llm.scheduler.step()
    assert all(len(times[part]) == steps for part in PARTS), "every step should be one decode step"
    per_step = [dict(zip(PARTS, values)) for values in zip(*(times[part] for part in PARTS))]
    rows = {"batch": [t["batch"] for t in per_step],
            "forward prep": [t["forward"] - t["hidden"] - t["logits"] for t in per_step],
            "sample prep": [t["sample"] - t["sampler"] for t in per_step],
            "commit": [t["commit"] for t in per_step],
            "host total": [t["step"] - t["hidden"] - t["logits"] - t["sampler"] for t in per_step],
            "(model, excluded)": [t["hidden"] + t["logits"] for t in per_step],
            "(sampler, excluded)": [t["sampler"] for t in per_step]}
    return {name: (statistics.median(values) * 1e3, min(values) * 1e3) for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions by own time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        model = str(make_tiny_model(f"{root}/qwen3", arch="qwen3", seed=0))
        results = {}
        for batch in args.batch:
            llm = decoding_llm(model, batch)
            times = instrument(llm)
            measure(llm, times, 20)  # warm-up
            if args.profile:
                profile = cProfile.Profile()
                profile.runcall(measure, llm, times, args.steps)
                print(f"batch {batch}: {args.steps} steps, top functions by own time")
                pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            results[batch] = measure(llm, times, args.steps)
            llm.shutdown()
    names = list(next(iter(results.values())))
    print("ms per decode step, median / fastest | " + " | ".join(f"batch {b:<9}" for b in results))
    for name in names:
        print(f"{name:36} | " + " | ".join("{:6.3f} / {:6.3f}".format(*results[b][name]) for b in results))


if __name__ == "__main__":
    main()
