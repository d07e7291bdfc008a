"""An optional timestamp trace of the server's token path, to see where a first token or an inter-token gap waits
(MINISGL_STEP_TRACE=FILE; off by default, and then nothing here runs).

Every time is `time.monotonic()`, the clock that the server's processes and a client's `time.perf_counter` share on
Linux. `StepTrace` writes FILE on the scheduler's TP leader, one JSON line per tick that did something:

- `t` (the tick's start); since then, in seconds: `build_s` (messages applied and its batch built), `launch_s`
  (the batch enqueued), `wait_from_s` and `read_s` (the host began to wait for a step's result, and had it: the
  difference is the time it blocked on the device), `tick_s` (the tick's end); on a server, a line `{"sent": T}`
  follows when the tick had outputs: when they were handed to the detokenizer's socket; `gc_ms` and `gc_gen`:
  the time Python's cyclic garbage collector ran in the tick (a pause of the host wherever it struck) and the
  oldest generation it collected (-1: none); `cpu_ms`: since the tick before (an idle one too, which writes no
  line), the CPU time of the scheduler's thread, of its process, and the time that thread waited for a CPU
  (Linux's run queue, /proc/thread-self/schedstat; 0 elsewhere): a tick slower than its work ran slowly, lent the
  GIL to another thread, or waited for a core; `allocator` (CUDA only): what PyTorch's caching allocator did since
  the last line (the first line: zeros, so the warm-up is not counted), as counts of ALLOCATOR_EVENTS (a failed
  cudaMalloc retried after freeing the cache, a sync of every stream, a device allocation, a device free: the first
  two wait for the device, and a free may too);
- the requests that arrived (`added`: [rid, prompt length]) and how many were retracted (`retracted`);
- the launched step: `step` (its number, or None), `decodes`, `chunks` ([rid, tokens] of its prefill part), `kind`
  (`graph`: a whole decode CUDA graph; `whole`: a whole-step graph of a step with prefill tokens; `eager`), `bucket`
  (the graph's batch size or token bucket) and `model_ms` (the start-up step cost model's estimate of its device
  time, engine/step_cost.py, which the scheduler sizes prefill chunks by; CUDA only);
- the step read in this tick: `read` (its number), `device_ms` (its span on the device, from an event recorded
  before its enqueue to one after its copies; CUDA only), `got` (the rids that got a token from it, in batch
  order: each tick reads at most one token per request) and `first` (those whose first token it was).

`MessageTrace` writes FILE.detok and FILE.api, one line per engine message that the detokenizer forwarded (`t`: just
before its send) or the API process routed (`t`: as it began): when, and the rids it carries.
benchmarks/ttft_trace.py and itl_trace.py join these to the client's timestamps.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref
from typing import TextIO

import torch

from minisgl.core import Batch, Req
from minisgl.engine.step_cost import StepCost

ENV = "MINISGL_STEP_TRACE"
ALLOCATOR_EVENTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class StepTrace:
    """The scheduler calls `launching` and `launched` around a batch's enqueue, `reading` and `read` around a step's
    result, `record` at the tick's end and (server) `sent` once the tick's outputs are sent."""

    def __init__(self, path: str, cuda: bool, cost: StepCost | None):
        self.file = open(path, "a", buffering=1)  # line by line: a server is stopped by a signal
        self.cuda, self.cost = cuda, cost  # cost: the model each step's `model_ms` comes from (None: no model)
        self.steps = 0  # steps launched so far
        self.numbers: dict[int, list] = {}  # id(batch) -> [step number, start event, end event] (events: CUDA only)
        self.tick: dict = {}  # this tick's launch and read, so far
        self.wrote = False  # a line for the last tick (so its send is worth a line)
        self.allocator: list[int] | None = None  # ALLOCATOR_EVENTS at the last line (CUDA; the first counts none)
        self.gc_began = 0.0
        self.cpu = cpu_counters()  # at the last line's end (or an idle tick's)
        collecting = weakref.WeakMethod(self._collecting)  # a finished engine's trace is not kept alive by gc
        gc.callbacks.append(lambda phase, info: (method := collecting()) and method(phase, info))

    def _collecting(self, phase: str, info: dict) -> None:
        """gc's callback around every collection: its time and generation go to the tick it falls in."""
        if phase == "start":
            self.gc_began = time.monotonic()
            return
        self.tick["gc_ms"] = self.tick.get("gc_ms", 0.0) + 1000 * (time.monotonic() - self.gc_began)
        self.tick["gc_gen"] = max(self.tick.get("gc_gen", -1), info["generation"])

    @classmethod
    def from_env(cls, is_leader: bool, device: torch.device, cost: StepCost | None) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path, device.type == "cuda", cost) if path and is_leader else None

    def launching(self, batch: Batch, kind: tuple[str, int | None]) -> None:
        """Just before `batch` is enqueued: number it, and mark the stream (the step's device span starts here)."""
        self.numbers[id(batch)] = [self.steps, self._event(), None]
        model_ms = round(self.cost.batch_ms(batch), 3) if self.cost else None
        self.tick.update(step=self.steps, kind=kind[0], bucket=kind[1], model_ms=model_ms, build_at=time.monotonic())
        self.steps += 1

    def launched(self, batch: Batch) -> None:
        """Just after `batch`'s step (forward, sampling, copies to the host) was enqueued."""
        self.numbers[id(batch)][2] = self._event()
        self.tick["launch_at"] = time.monotonic()

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _allocator_counts(self) -> list[int] | None:
        if not self.cuda:
            return None
        stats = torch.cuda.memory_stats()
        return [stats.get(event, 0) for event in ALLOCATOR_EVENTS]

    def reading(self) -> None:
        self.tick["read_from"] = time.monotonic()

    def read(self, batch: Batch) -> None:
        """Just after the result of `batch`'s step was read."""
        read_at = time.monotonic()
        number, began, ended = self.numbers.pop(id(batch), (None, None, None))
        if ended is not None:
            ended.synchronize()  # recorded just after the event the read waited for
        self.tick.update(read=number, read_at=read_at,
                         device_ms=round(began.elapsed_time(ended), 3) if ended is not None else None)

    def record(self, start: float, added: list[Req], retracted: int, batch: Batch | None, got: list[Req]) -> None:
        """The tick's line; `got`: the requests that got a token in it."""
        tick, self.tick = self.tick, {}
        cpu, self.cpu = self.cpu, cpu_counters()
        self.wrote = bool(added or batch or "read" in tick)
        if not self.wrote:  # an idle tick
            return
        decodes = batch.decodes if batch else 0  # the prefill chunks follow them, a one-token last chunk too
        chunks = [[r.rid, n] for r, n in zip(batch.reqs[decodes:], batch.extend_lens[decodes:])] if batch else []
        allocator = self._allocator_counts()
        before, self.allocator = self.allocator or allocator, allocator
        since = {key: round(tick[at] - start, 6) if at in tick else None
                 for key, at in (("build_s", "build_at"), ("launch_s", "launch_at"), ("wait_from_s", "read_from"),
                                 ("read_s", "read_at"))}
        write_line(self.file, {
            "t": round(start, 6), **since, "tick_s": round(time.monotonic() - start, 6),
            "added": [[r.rid, len(r.prompt_ids)] for r in added], "retracted": retracted,
            "step": tick.get("step"), "kind": tick.get("kind"), "bucket": tick.get("bucket"),
            "model_ms": tick.get("model_ms"),
            "decodes": decodes, "chunks": chunks,
            "read": tick.get("read"), "device_ms": tick.get("device_ms"),
            "got": [r.rid for r in got], "first": [r.rid for r in got if len(r.output_ids) == 1],
            "gc_ms": round(tick.get("gc_ms", 0.0), 3), "gc_gen": tick.get("gc_gen", -1),
            "cpu_ms": [round(1000 * (now - then), 3) for now, then in zip(self.cpu, cpu)],
            "allocator": [now - then for now, then in zip(allocator, before)] if allocator is not None else None})

    def sent(self) -> None:
        """The last tick's outputs are being sent to the detokenizer (just before: the detokenizer's own stamp for
        them comes later)."""
        if self.wrote:
            write_line(self.file, {"sent": round(time.monotonic(), 6)})


def cpu_counters() -> tuple[float, float, float]:
    """Seconds so far: this thread's CPU time, its process's (every thread's), and this thread's wait in the run
    queue (Linux; 0.0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
    except OSError:
        waited = 0.0
    return time.thread_time(), time.process_time(), waited


class MessageTrace:
    """One line per engine message a process passes on: when, and the rids it carries (FILE.detok, FILE.api)."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls, suffix: str) -> MessageTrace | None:
        path = os.environ.get(ENV)
        return cls(f"{path}.{suffix}") if path else None

    def record(self, at: float, rids: list[int]) -> None:
        write_line(self.file, {"t": round(at, 6), "rids": rids})


def write_line(file: TextIO, line: dict) -> None:
    """One compact JSON line (files are line-buffered: a server stopped by a signal loses no whole line)."""
    file.write(json.dumps(line, separators=(",", ":")) + "\n")
