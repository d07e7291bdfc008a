"""Host time to enqueue one step with prefill tokens, and the device's time for it, with the whole-step CUDA
graphs (minisgl/engine/whole_graph.py) and without, in the same engine (dummy weights).

    python benchmarks/prefill_enqueue.py --config .bench_models/qwen3-0.6b.json [--steps 626,16x1+512,2048]

A step is `P` (one prompt of P tokens) or `DxN+P` (D requests feeding N tokens each, e.g. decodes, plus a
prompt chunk of P: a mixed step). `host_ms` is `Engine.forward` on the host (the enqueue); `device_ms` the
device's own time for it, measured behind a sleeping kernel so that the host's enqueue is hidden from it.
Prints one JSON line per step and mode, medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req

SLEEP_CYCLES = 200_000_000  # ~0.1 s of a ~2 GHz GPU: longer than any enqueue measured here


def parse_step(spec: str) -> list[int]:
    """'626' -> [626]; '16x1+512' -> [1] * 16 + [512]."""
    lens = []
    for part in spec.split("+"):
        count, _, n = part.rpartition("x")
        lens += [int(n)] * int(count or 1)
    return lens


def make_batch(lens: list[int]) -> Batch:
    reqs = [Req(i, [0] * max(n, 1), SamplingParams(max_tokens=1), seed=0, row=i) for i, n in enumerate(lens)]
    kv = [64 if n == 1 else 0 for n in lens]  # one-token entries decode after a 64-token context
    return Batch(reqs, kv, lens, sampled=list(range(len(lens))))


def measure(llm: LLM, batch: Batch, repeats: int) -> tuple[float, float]:
    engine, host, device = llm.engine, [], []
    for _ in range(repeats + 1):  # the first warms up
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        engine.forward(batch)
        host.append(1000 * (time.perf_counter() - start))
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end))
    return statistics.median(host[1:]), statistics.median(device[1:])


def main() -> None:
    from offline import model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", default="626,16x1+512,64x1+1024,2048")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    llm = LLM(model_dir(a.config), dummy_weights=True, max_running_requests=256)
    graphs = llm.engine.whole
    for spec in a.steps.split(","):
        batch = make_batch(parse_step(spec))
        for mode in ("whole", "eager"):
            llm.engine.whole = graphs if mode == "whole" else None
            host, device = measure(llm, batch, a.repeats)
            print(json.dumps({"step": spec, "tokens": sum(batch.extend_lens), "mode": mode,
                              "host_ms": round(host, 2), "device_ms": round(device, 2)}), flush=True)
    llm.engine.whole = graphs
    llm.shutdown()


if __name__ == "__main__":
    main()
