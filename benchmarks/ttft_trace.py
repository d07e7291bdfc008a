"""Where a request's first token waits: client timestamps (`online.py --requests-out`) against the server's
scheduler trace (`MINISGL_STEP_TRACE`), both on the machine's monotonic clock.

    python benchmarks/ttft_trace.py requests.jsonl trace.jsonl

Each request is matched to the first trace arrival with its prompt length at or after it was sent. Stages,
median and p90 in ms per concurrency level: `to_scheduler` (sent -> the scheduler tick that took it in),
`queued` (-> the tick that launched its first chunk), `prefill` (-> the end of the tick that read its first
token: chunks, and one more step with overlap), `to_client` (-> its first chunk at the client: detokenizer,
API process, HTTP).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(requests_path: str, trace_path: str) -> None:
    ticks = [json.loads(line) for line in open(trace_path)]
    arrived, launched, read = [], {}, {}
    for tick in ticks:
        arrived += [(tick["t"], rid, n) for rid, n in tick["added"] if rid >= 0]
        for rid, _ in tick["chunks"]:
            launched.setdefault(rid, tick["t"])
        for rid in tick["first"]:
            read.setdefault(rid, tick["t"] + tick["tick_s"])
    taken: set[int] = set()
    stages: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for req in sorted((json.loads(line) for line in open(requests_path)), key=lambda r: r["start"]):
        match = next(((t, rid) for t, rid, n in arrived
                      if n == req["prompt_len"] and t >= req["start"] - 1e-3 and rid not in taken), None)
        if match is None or match[1] not in read:
            continue
        t, rid = match
        taken.add(rid)
        start = launched.get(rid, t)
        level = stages[req["streams"]]
        for name, ms in (("to_scheduler", t - req["start"]), ("queued", start - t), ("prefill", read[rid] - start),
                         ("to_client", req["first"] - read[rid]), ("ttft", req["first"] - req["start"])):
            level[name].append(1000 * ms)
    print("| streams | matched | " + " | ".join(f"{n} p50 / p90 (ms)" for n in next(iter(stages.values()), {})) + " |")
    for streams, level in sorted(stages.items()):
        cells = " | ".join(f"{percentile(v, 50):.1f} / {percentile(v, 90):.1f}" for v in level.values())
        print(f"| {streams} | {len(level['ttft'])} | {cells} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
