"""Where a request's first token waits: client timestamps (`online.py --requests-out`) against the server's
scheduler trace (`MINISGL_STEP_TRACE`), both on the machine's monotonic clock.

    python benchmarks/ttft_trace.py requests.jsonl trace.jsonl

Each request is matched to the first trace arrival with its prompt length at or after it was sent. Stages,
median and p90 in ms per concurrency level: `to_scheduler` (sent -> the scheduler tick that took it in),
`queued` (-> the tick that launched its first chunk), `prefill` (-> the end of the tick that read its first
token: chunks, and one more step with overlap), `to_client` (-> its first chunk at the client: detokenizer,
API process, HTTP). benchmarks/itl_trace.py does the same for the gaps between later tokens, with the helpers here.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online import percentile  # noqa: E402


def json_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_ticks(path: str) -> list[dict]:
    """The scheduler's tick lines, each with `sent` (None offline: the line after a tick's on a server)."""
    ticks: list[dict] = []
    for line in json_lines(path):
        if "t" in line:
            ticks.append({**line, "sent": None})
        elif ticks:
            ticks[-1]["sent"] = line["sent"]
    return ticks


def match_requests(requests: list[dict], ticks: list[dict]) -> list[tuple[dict, int, float]]:
    """(request, its rid, the start of the tick that took it in) for each client request found in the trace: the
    first arrival with its prompt length at or after it was sent, in the order they were sent."""
    arrived = [(tick["t"], rid, n) for tick in ticks for rid, n in tick["added"] if rid >= 0]
    taken: set[int] = set()
    found = []
    for req in sorted(requests, key=lambda r: r["start"]):
        match = next(((t, rid) for t, rid, n in arrived
                      if n == req["prompt_len"] and t >= req["start"] - 1e-3 and rid not in taken), None)
        if match is not None:
            taken.add(match[1])
            found.append((req, match[1], match[0]))
    return found


def main(requests_path: str, trace_path: str) -> None:
    ticks = read_ticks(trace_path)
    launched, read = {}, {}
    for tick in ticks:
        for rid, _ in tick["chunks"]:
            launched.setdefault(rid, tick["t"])
        for rid in tick["first"]:
            read.setdefault(rid, tick["t"] + tick["tick_s"])
    stages: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for req, rid, t in match_requests(json_lines(requests_path), ticks):
        if rid not in read:
            continue
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
