"""Where a run's steps spend their time, from the scheduler's step trace: which kinds and sizes of step there were,
how long the device ran each, and how long it sat idle between them (the host's time that no step hid).

    MINISGL_STEP_TRACE=/tmp/w1.jsonl python benchmarks/offline.py --config .bench_models/qwen3-8b.json --workload w1
    python benchmarks/step_summary.py /tmp/w1.jsonl --since-last-arrival

For an offline workload, where no client waits and only the total counts (W1: is it the decode steps, the prefill
chunks, or the host between them?). Steps are grouped by kind (`graph`: a whole decode CUDA graph, `whole`:
a whole-step graph of a step with prefill tokens, `eager`) and by what they hold: decodes only, prefill only, or both
(`mixed`), and the number of decodes (classes up to 1, 16, 64, 128, 256 and beyond). Per group: steps; their device
time (sum, share of all steps', mean per step; CUDA only: the trace's `device_ms`); decodes and prefill tokens per
step; the host's time per step to build the batch and to enqueue it; and (CUDA) the device time over the step
cost model's estimate (the trace's `model_ms`: the start-up model the scheduler sizes its chunks by). Last, the
trace's wall span from the first launch to the last read against the device's sum: the difference is time the
device had nothing queued.
`--since-last-arrival` keeps only the steps from the last tick that admitted requests on: an offline workload's
timed generate, without the engine's warm-up and the workload's own warm-up before it.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DECODE_CLASSES = (1, 16, 64, 128, 256)  # upper bounds of the decode-count classes; the last class is open


@dataclass
class Step:
    kind: str
    decodes: int
    prefill: int
    build_ms: float
    enqueue_ms: float
    model_ms: float | None = None
    device_ms: float | None = None


@dataclass
class Group:
    steps: list[Step] = field(default_factory=list)

    def mean(self, attr: str) -> float:
        return sum(getattr(s, attr) for s in self.steps) / len(self.steps)

    def device_ms(self) -> float | None:
        times = [s.device_ms for s in self.steps]
        return None if None in times else sum(times)

    def over_model(self) -> float | None:
        """The group's device time over the cost model's estimate of it (steps with both only)."""
        both = [(s.device_ms, s.model_ms) for s in self.steps if s.device_ms is not None and s.model_ms]
        return sum(d for d, _ in both) / sum(m for _, m in both) if both else None


def read_steps(path: Path, since_last_arrival: bool = False) -> tuple[list[Step], float]:
    """The launched steps in launch order (their device time joined from the tick that read them), and the wall
    span in ms from the first launch to the last read."""
    ticks = [json.loads(line) for line in path.read_text().splitlines()]
    ticks = [tick for tick in ticks if "step" in tick]  # a server's trace also has its sends' lines
    if since_last_arrival:
        ticks = ticks[max((i for i, tick in enumerate(ticks) if tick["added"]), default=0):]
    steps: dict[int, Step] = {}
    first_launch = last_read = None
    for tick in ticks:
        if tick.get("step") is not None:
            prefill = sum(n for _, n in tick["chunks"])
            build = tick["build_s"] or 0.0
            steps[tick["step"]] = Step(tick["kind"], tick["decodes"], prefill, 1000 * build,
                                       1000 * ((tick["launch_s"] or build) - build), tick.get("model_ms"))
            first_launch = first_launch if first_launch is not None else tick["t"] + build
        if tick.get("read") is not None:
            if tick["read"] in steps:
                steps[tick["read"]].device_ms = tick["device_ms"]
            last_read = tick["t"] + (tick["read_s"] or 0.0)
    span = 1000 * (last_read - first_launch) if steps and last_read is not None else 0.0
    return [steps[n] for n in sorted(steps)], span


def group_key(step: Step) -> tuple[str, str, str]:
    holds = "mixed" if step.decodes and step.prefill else "decode" if step.decodes else "prefill"
    i = bisect.bisect_left(DECODE_CLASSES, step.decodes)
    decodes = f"<= {DECODE_CLASSES[i]}" if i < len(DECODE_CLASSES) else f"> {DECODE_CLASSES[-1]}"
    return step.kind, holds, decodes if step.decodes else "0"


def summarize(steps: list[Step], span_ms: float) -> str:
    groups: dict[tuple[str, str, str], Group] = defaultdict(Group)
    for step in steps:
        groups[group_key(step)].steps.append(step)
    total = sum(s.device_ms for s in steps if s.device_ms is not None)
    timed = all(s.device_ms is not None for s in steps)
    rows = ["| kind | holds | decodes | steps | device ms (sum / share / mean) | decodes / step | prefill / step "
            "| build / enqueue ms per step | device / model |", "|---|---|---|---|---|---|---|---|---|"]
    order = sorted(groups, key=lambda k: -(groups[k].device_ms() or 0.0) if timed else k)
    for key in order:
        group = groups[key]
        device = group.device_ms()
        device_cell = (f"{device:,.1f} / {device / total:.0%} / {device / len(group.steps):.2f}"
                       if device is not None and total else "-")
        ratio = group.over_model()
        rows.append(f"| {' | '.join(key)} | {len(group.steps)} | {device_cell} | {group.mean('decodes'):.1f} | "
                    f"{group.mean('prefill'):.1f} | {group.mean('build_ms'):.2f} / {group.mean('enqueue_ms'):.2f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    tokens = sum(s.decodes for s in steps), sum(s.prefill for s in steps)
    rows.append(f"\n{len(steps)} steps, {tokens[0]:,} decode and {tokens[1]:,} prefill tokens; wall span "
                f"{span_ms:,.1f} ms" + (f", device {total:,.1f} ms ({total / span_ms:.0%}), idle "
                                        f"{span_ms - total:,.1f} ms" if timed and span_ms else ""))
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="the scheduler's trace (MINISGL_STEP_TRACE)")
    p.add_argument("--since-last-arrival", action="store_true",
                   help="only the steps from the last tick that admitted requests on (an offline timed generate)")
    a = p.parse_args()
    steps, span = read_steps(a.trace, a.since_last_arrival)
    print(summarize(steps, span))


if __name__ == "__main__":
    main()
