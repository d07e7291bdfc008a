"""Where a long inter-token gap waits: every chunk's arrival at the client (`online.py --requests-out`) joined to
the server's trace (`MINISGL_STEP_TRACE=FILE`: the scheduler's ticks in FILE, the detokenizer's and the API
process's messages in FILE.detok and FILE.api), all on the machine's monotonic clock.

    python benchmarks/itl_trace.py requests.jsonl trace.jsonl [--threshold-ms MS]

A gap is the time between two consecutive chunks of a request at the client. Its last token was read by some
scheduler tick and the previous chunk's by an earlier one, so the gap splits exactly into:

- the scheduler's part, the time between the two ticks' sends, itself the sum over the ticks between of: `loop`
  (from the last send to the next tick: receiving messages, idle ticks), `build` (messages applied, the batch
  built: admissions), `enqueue` (the batch's forward and sampling enqueued, by its kind: `graph`, `whole`,
  `eager`), `device` (the host blocked on a step's result, by whether that step carried prefill chunks: `mixed`
  or `decode`), `commit` (the rest of the tick: tokens appended, finishes) and `report` (outputs gathered);
- `detok` and `api` (how much longer the later token took than the earlier from the scheduler's send to the
  detokenizer's, pickling and IPC included, and from there to the API process's routing), and `to_client` (the
  same from the routing to the client: the API's loop, HTTP, the client's parsing).

A negative part means the earlier chunk was the one held at that stage (a late chunk shortens the gap after it).
A gap is long above `--threshold-ms`, by default each level's p99. Per level: how many long gaps; each part's mean
over the long gaps, its share of their time, its mean over all gaps, and how many long gaps it is the cause of (the
part that exceeds its all-gaps mean the most); how often a long gap's ticks held a step of each kind (or the gap
before it was long too, a garbage collection ran in them, or, on CUDA, the caching allocator freed, retried or
allocated device memory, or the scheduler's thread waited over RUN_QUEUE_MS for a core), against how often any
gap's did; on CUDA the device span of the steps read in a gap's ticks; the scheduler's garbage-collection time in
them; and its thread's CPU time and run-queue wait in them (the trace's `cpu_ms`): a long gap whose thread waited
for a core was a machine's stall, not the schedule's.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online import percentile  # noqa: E402
from ttft_trace import json_lines, match_requests, read_ticks  # noqa: E402

RUN_QUEUE_MS = 1.0  # a tick whose scheduler thread waited longer than this for a core is flagged

PARTS = ("loop", "build", "enqueue graph", "enqueue whole", "enqueue eager", "device decode", "device mixed",
         "commit", "report", "detok", "api", "to_client")


@dataclass
class Gap:
    ms: float
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))  # ms
    flags: set[str] = field(default_factory=set)  # what its ticks held (see `window`)
    prefill_tokens: int = 0  # the most any step read in its ticks carried
    device_ms: float | None = None  # the device spans of the steps read in its ticks (CUDA only)
    gc_ms: float = 0.0  # the scheduler's garbage collections in its ticks
    thread_cpu_ms: float = 0.0  # the scheduler thread's CPU time in its ticks
    run_queue_ms: float = 0.0  # the time that thread waited for a core in them
    previous_ms: float | None = None  # the request's gap before this one


class Trace:
    """The server's side of the join: the ticks, each request's token -> the tick that read it, and when each of a
    request's outputs passed the detokenizer and the API process."""

    def __init__(self, path: str):
        self.ticks = read_ticks(path)
        self.token_ticks: dict[int, list[int]] = defaultdict(list)  # rid -> tick index of its k-th token
        self.launched_by: dict[int, dict] = {}  # step number -> the tick that launched it
        for i, tick in enumerate(self.ticks):
            for rid in tick["got"]:
                self.token_ticks[rid].append(i)
            if tick["step"] is not None:
                self.launched_by[tick["step"]] = tick
        self.passed = {suffix: self._messages(f"{path}.{suffix}") for suffix in ("detok", "api")}

    @staticmethod
    def _messages(path: str) -> dict[int, list[float]]:
        """rid -> when each of its outputs passed (its k-th output carries its k-th token: one per tick)."""
        times: dict[int, list[float]] = defaultdict(list)
        if Path(path).exists():
            for line in json_lines(path):
                for rid in line["rids"]:
                    times[rid].append(line["t"])
        return times

    def sent(self, i: int) -> float:
        tick = self.ticks[i]
        return tick["sent"] if tick["sent"] is not None else tick["t"] + tick["tick_s"]

    def window(self, gap: Gap, after: int, upto: int) -> None:
        """Add the scheduler's part of the time between the sends of ticks `after` and `upto` to `gap`."""
        if upto - after > 1:
            gap.flags.add("several ticks")
        for i in range(after + 1, upto + 1):
            tick = self.ticks[i]
            wait = ms(tick["read_s"]) - ms(tick["wait_from_s"])
            gap.parts["loop"] += ms(tick["t"] - self.sent(i - 1))
            gap.parts["build"] += ms(tick["build_s"])
            if tick["kind"] is not None:
                gap.parts[f"enqueue {tick['kind']}"] += ms(tick["launch_s"]) - ms(tick["build_s"])
                gap.flags.add(f"launched {tick['kind']}")
                if tick["read"] is None:  # the previous step was read (and sent) a tick early: a first token in it
                    gap.flags.add("a launch without a read")
            read = self.launched_by.get(tick["read"])
            if tick["device_ms"] is not None:
                gap.device_ms = (gap.device_ms or 0.0) + tick["device_ms"]
            prefill = sum(n for _, n in read["chunks"]) if read else 0
            gap.parts["device mixed" if prefill else "device decode"] += wait
            if prefill:
                gap.flags.add("read a mixed step")
                gap.prefill_tokens = max(gap.prefill_tokens, prefill)
            gap.parts["commit"] += ms(tick["tick_s"]) - ms(tick["launch_s"]) - wait
            gap.parts["report"] += ms(self.sent(i) - tick["t"] - tick["tick_s"])
            if tick["added"]:
                gap.flags.add("requests arrived")
            if tick["retracted"]:
                gap.flags.add("retraction")
            retries, syncs, allocs, frees = tick.get("allocator") or (0, 0, 0, 0)  # CPU and older traces have none
            if retries or syncs or frees:
                gap.flags.add("an allocator retry, stream sync or device free")
            if allocs:
                gap.flags.add("a device allocation")
            thread_cpu, _, queued = tick.get("cpu_ms") or (0.0, 0.0, 0.0)  # older traces have none
            gap.thread_cpu_ms += thread_cpu
            gap.run_queue_ms += queued
            if queued > RUN_QUEUE_MS:
                gap.flags.add(f"the scheduler thread waited over {RUN_QUEUE_MS:g} ms for a core")
            if tick.get("gc_gen", -1) >= 0:  # older traces have no gc fields
                gap.flags.add(f"a gen-{tick['gc_gen']} garbage collection")
                gap.gc_ms += tick["gc_ms"]


def ms(seconds: float | None) -> float:
    return 1000 * (seconds or 0.0)


def gaps_of(req: dict, rid: int, trace: Trace) -> list[Gap]:
    """The request's gaps, each split into PARTS (those the trace cannot place stay 0 and go to `to_client`)."""
    counts = req.get("n") or [1] * len(req["after_us"])
    arrivals = [req["first"] + us / 1e6 for us in req["after_us"]]
    last, total = [], 0
    for n in counts:
        total += n
        last.append(total - 1)  # the chunk's last token
    ticks = trace.token_ticks.get(rid, [])
    detok, api = (trace.passed[s].get(rid, []) for s in ("detok", "api"))
    found = []
    for k in range(1, len(arrivals)):
        before, now = last[k - 1], last[k]
        if now >= len(ticks):
            break
        gap = Gap(1000 * (arrivals[k] - arrivals[k - 1]), previous_ms=found[-1].ms if found else None)
        trace.window(gap, ticks[before], ticks[now])
        # Each stage's later token against its earlier one: what the gap gained from one stage to the next.
        stages = [trace.sent(ticks[before]), trace.sent(ticks[now])]
        for name, times in (("detok", detok), ("api", api)):
            if len(times) == len(ticks):
                reached = [times[before], times[now]]
                gap.parts[name] = 1000 * ((reached[1] - stages[1]) - (reached[0] - stages[0]))
                stages = reached
        gap.parts["to_client"] = 1000 * ((arrivals[k] - stages[1]) - (arrivals[k - 1] - stages[0]))
        found.append(gap)
    return found


def report(streams: int, gaps: list[Gap], threshold_ms: float | None) -> str:
    threshold = threshold_ms if threshold_ms is not None else percentile([g.ms for g in gaps], 99)
    long = [g for g in gaps if g.ms > threshold]
    lines = [f"### {streams} streams: {len(long)} of {len(gaps)} gaps above {threshold:.2f} ms "
             f"(mean {sum(g.ms for g in long) / max(1, len(long)):.2f} ms, all gaps' mean "
             f"{sum(g.ms for g in gaps) / len(gaps):.2f} ms)", "",
             "| part | long gaps' mean (ms) | share of long-gap time | all gaps' mean (ms) | cause of |",
             "|---|---|---|---|---|"]
    long_time = sum(g.ms for g in long) or 1.0
    usual = {part: sum(g.parts[part] for g in gaps) / len(gaps) for part in PARTS}
    causes = Counter(max(PARTS, key=lambda part: g.parts[part] - usual[part]) for g in long)
    for part in PARTS:
        mean_long = sum(g.parts[part] for g in long) / max(1, len(long))
        lines.append(f"| {part} | {mean_long:.2f} | {100 * sum(g.parts[part] for g in long) / long_time:.0f}% | "
                     f"{usual[part]:.2f} | {causes[part]} |")
    lines += ["", "| its ticks held | long gaps | all gaps |", "|---|---|---|"]
    tests = {flag: (lambda g, f=flag: f in g.flags) for flag in sorted({f for g in gaps for f in g.flags})}
    # long stalls back to back (consecutive prefill-heavy steps, say) rather than one at a time
    tests["(the gap before was long too)"] = lambda g: (g.previous_ms or 0.0) > threshold
    for name, held in tests.items():
        lines.append(f"| {name} | {100 * sum(map(held, long)) / max(1, len(long)):.0f}% | "
                     f"{100 * sum(map(held, gaps)) / len(gaps):.0f}% |")
    mixed = [g.prefill_tokens for g in long if g.prefill_tokens]
    if mixed:
        lines.append(f"\nprefill tokens of the largest mixed step read in a long gap: p50 {percentile(mixed, 50)}, "
                     f"max {max(mixed)}")
    spans = [[g.device_ms for g in group if g.device_ms is not None] for group in (long, gaps)]
    if spans[0] and spans[1]:
        lines.append(f"\ndevice span of the steps read in a gap's ticks, mean: long gaps {mean(spans[0]):.2f} ms, "
                     f"all gaps {mean(spans[1]):.2f} ms")
    if any(g.gc_ms for g in gaps):
        collected = [mean([g.gc_ms for g in group]) for group in (long, gaps)]
        lines.append(f"\nscheduler garbage collection in a gap's ticks, mean: long gaps {collected[0]:.2f} ms, "
                     f"all gaps {collected[1]:.2f} ms")
    if any(g.thread_cpu_ms for g in gaps):
        on_core, waiting = ([mean([getattr(g, f) for g in group] or [0.0]) for group in (long, gaps)]
                            for f in ("thread_cpu_ms", "run_queue_ms"))
        lines.append(f"\nthe scheduler thread in a gap's ticks, mean: on a core, long gaps {on_core[0]:.2f} ms, all "
                     f"gaps {on_core[1]:.2f} ms; waiting for one, long gaps {waiting[0]:.2f} ms, all gaps "
                     f"{waiting[1]:.2f} ms")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("requests", help="online.py --requests-out file")
    p.add_argument("trace", help="the MINISGL_STEP_TRACE file (FILE.detok and FILE.api beside it, if there)")
    p.add_argument("--threshold-ms", type=float, help="a long gap's least length (default: each level's p99)")
    a = p.parse_args()
    trace = Trace(a.trace)
    levels: dict[int, list[Gap]] = defaultdict(list)
    for req, rid, _ in match_requests(json_lines(a.requests), trace.ticks):
        levels[req["streams"]] += gaps_of(req, rid, trace)
    for streams, gaps in sorted(levels.items()):
        if gaps:
            print(report(streams, gaps, a.threshold_ms) + "\n")


if __name__ == "__main__":
    main()
