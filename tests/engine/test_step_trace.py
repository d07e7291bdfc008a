"""MINISGL_STEP_TRACE: the scheduler's per-tick trace shows each request's arrival, chunks and first token."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req
from minisgl.engine.step_cost import StepCost
from minisgl.scheduler.trace import StepTrace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from helpers import DEVICE
from itl_trace import Trace, gaps_of, report  # noqa: E402


def test_trace_follows_a_chunked_prompt_to_its_first_token(tiny_models, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    llm = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", num_pages=1024, cuda_graph_max_bs=8,
              max_prefill_tokens=16)
    try:
        short, long = llm.generate([[5, 6, 7], list(range(10, 50))], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        llm.shutdown()
    ticks = [json.loads(line) for line in path.read_text().splitlines()]
    rids = {n: rid for rid, n in ticks[0]["added"]}  # the warm-up's requests are not traced
    assert set(rids) == {3, 40} and all(t["t"] <= u["t"] for t, u in zip(ticks, ticks[1:]))
    chunks = [n for t in ticks for rid, n in t["chunks"] if rid == rids[40]]
    assert sum(chunks) == 40 and max(chunks) <= 16 and len(chunks) >= 3  # chunked within the budget
    first = [k for k, t in enumerate(ticks) if rids[40] in t["first"]]
    last_chunk = max(k for k, t in enumerate(ticks) if rids[40] in (rid for rid, _ in t["chunks"]))
    assert len(first) == 1 and first[0] > last_chunk  # read once, after its last chunk was launched
    assert len(short.token_ids) == len(long.token_ids) == 3


def test_trace_numbers_steps_and_reads_each_token_once(tiny_models, tmp_path, monkeypatch):
    """Every launched step is read once, after it was launched; each request appears in `got` once per token."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    outs = traced_run(tiny_models, path)
    ticks = [json.loads(line) for line in path.read_text().splitlines()]
    launched = {t["step"]: k for k, t in enumerate(ticks) if t["step"] is not None}
    reads = [(t["read"], k) for k, t in enumerate(ticks) if t["read"] is not None]
    assert sorted(launched) == list(range(len(launched))) == sorted(step for step, _ in reads)
    assert all(launched[step] <= k for step, k in reads)  # with overlap, usually the tick after
    kinds = {t["kind"] for t in ticks if t["step"] is not None}
    device_ms = [t["device_ms"] for t in ticks if t["read"] is not None]
    model_ms = [t["model_ms"] for t in ticks if t["step"] is not None]
    if DEVICE == "cpu":  # no CUDA graphs, no device events, no step cost model
        assert kinds == {"eager"} and device_ms == [None] * len(reads) and model_ms == [None] * len(launched)
    else:  # the decodes of two requests replay a graph; every step's device span is measured
        assert "graph" in kinds and kinds <= {"graph", "whole", "eager"} and all(ms > 0 for ms in device_ms)
        assert all(ms > 0 for ms in model_ms)
    assert all("sent" not in t for t in ticks)  # offline: no detokenizer to send to
    got = Counter(rid for t in ticks for rid in t["got"] if rid >= 0)
    assert sorted(got.values()) == sorted(len(o.token_ids) for o in outs)


def test_a_steps_decodes_and_model_ms_are_its_leading_decodes(tmp_path):
    """A step's `decodes` and `chunks` split it where the engine's attention metadata does: its leading one-token
    requests are the decodes, and a prompt's one-token last chunk after them is a chunk. `model_ms` is the cost
    model at the step's tokens and the cached tokens of those decodes: that last chunk reads no decode's cache."""
    cost = StepCost(tokens=(16, 64), linear_ms=(1.0, 4.0), kv_ms_per_token=0.01)
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path), cuda=False, cost=cost)
    reqs = [Req(i, [3] * 8, SamplingParams(max_tokens=4), seed=0) for i in range(4)]
    batch = Batch(reqs, kv_lens=[100, 200, 30, 500], extend_lens=[1, 1, 30, 1], sampled=[0, 1, 3])
    trace.launching(batch, ("eager", None))
    # 2.06 + 3.0 ms (rounded to the microsecond); with the 500 after the chunk it would be 10.06
    assert trace.tick["model_ms"] == pytest.approx(cost.ms(33) + 300 * 0.01, abs=1e-3)
    trace.record(0.0, [], 0, batch, [])
    line = json.loads(path.read_text())
    assert line["decodes"] == 2 and line["chunks"] == [[2, 30], [3, 1]]
    untimed = StepTrace(str(tmp_path / "untimed.jsonl"), cuda=False, cost=None)
    untimed.launching(batch, ("eager", None))
    assert untimed.tick["model_ms"] is None


def traced_run(tiny_models, path) -> list:
    """The outputs of a short prompt decoding while a long one is chunked in beside it (16 tokens a step)."""
    llm = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", num_pages=1024, cuda_graph_max_bs=8,
              max_prefill_tokens=16)
    try:
        return llm.generate([[5, 6, 7], list(range(10, 50))], SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()


def test_itl_trace_places_a_client_delay_and_the_mixed_steps(tiny_models, tmp_path, monkeypatch):
    """benchmarks/itl_trace.py on a real trace, with client arrivals made up from it: each chunk 1 ms after its
    tick's end, from the fifth on 5 s later (a client that stalled). The fifth chunk's gap grows by 5 s, all of it
    `to_client`, and no other gap's `to_client` moves; every gap's parts add up to it; the short request's gaps that
    read a step of the long prompt's chunks say so."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    outs = traced_run(tiny_models, path)
    trace = Trace(str(path))
    rid = next(rid for t in trace.ticks for rid, n in t["added"] if n == 3)
    ends = [trace.sent(i) for i in trace.token_ticks[rid]]
    assert len(ends) == len(outs[0].token_ids) == 8
    arrivals = [end + 0.001 + (5.0 if k >= 4 else 0) for k, end in enumerate(ends)]
    request = {"streams": 1, "prompt_len": 3, "start": ends[0] - 0.01, "first": arrivals[0],
               "after_us": [round(1e6 * (a - arrivals[0])) for a in arrivals]}
    gaps = gaps_of(request, rid, trace)
    assert len(gaps) == 7
    for gap in gaps:
        assert abs(sum(gap.parts.values()) - gap.ms) < 0.01
    assert abs(gaps[3].parts["to_client"] - 5000) < 0.01
    assert all(abs(g.parts["to_client"]) < 0.01 for k, g in enumerate(gaps) if k != 3)
    chunks = [n for t in trace.ticks for r, n in t["chunks"] if r != rid and r >= 0]
    mixed = [g.prefill_tokens for g in gaps if "read a mixed step" in g.flags]
    assert mixed and all(0 < n <= 16 for n in mixed) and set(mixed) <= set(chunks)
    table = report(1, gaps, threshold_ms=4000)  # no step of this tiny model takes seconds
    assert "1 of 7 gaps above 4000.00 ms" in table
    assert "| to_client | 5000.00 | " in table and table.split("| to_client |")[1].split("\n")[0].endswith("| 1 |")


def ticks_with(tiny_models, tmp_path, monkeypatch, actions: dict[int, Callable[[], None]],
               max_tokens: int) -> list[dict]:
    """The trace lines of one request's steps, in order, with `actions[k]` run inside the k-th step's enqueue
    (1-based): what it does to the host shows in that step's tick."""
    from minisgl.engine.engine import Engine

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    llm = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", num_pages=1024, cuda_graph_max_bs=8)
    forward, steps = Engine.forward, []

    def forward_acting(engine, batch):
        steps.append(llm.scheduler.trace.steps - 1)  # the trace numbered this step just before
        actions.get(len(steps), lambda: None)()
        return forward(engine, batch)

    monkeypatch.setattr(Engine, "forward", forward_acting)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.shutdown()
    by_step = {t["step"]: t for t in map(json.loads, path.read_text().splitlines()) if t.get("step") in steps}
    return [by_step[step] for step in steps]  # this generate's, not the warm-up's


def test_trace_puts_a_garbage_collection_in_the_tick_it_paused(tiny_models, tmp_path, monkeypatch):
    """A full collection forced while one step is enqueued shows in that step's tick, with its generation and
    time, and in no other (automatic collection is off meanwhile; a young-generation one may still run)."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ticks = ticks_with(tiny_models, tmp_path, monkeypatch, {3: gc.collect}, max_tokens=6)
    finally:
        if was_enabled:
            gc.enable()
    assert [k for k, t in enumerate(ticks) if t["gc_gen"] == 2] == [2] and ticks[2]["gc_ms"] > 0


def test_trace_tells_a_tick_that_computed_from_one_that_waited(tiny_models, tmp_path, monkeypatch):
    """`cpu_ms` (the scheduler thread's CPU, its process's, its run-queue wait): a step whose enqueue spins the
    CPU for 30 ms shows ~30 ms of thread CPU in its tick, and one whose enqueue sleeps 30 ms almost none; a
    busy second thread shows in the process's CPU only."""
    def spin(seconds: float = 0.03) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def spin_in_a_thread() -> None:
        worker = threading.Thread(target=spin)
        worker.start()
        worker.join()

    ticks = ticks_with(tiny_models, tmp_path, monkeypatch, {2: spin, 4: lambda: time.sleep(0.03), 6: spin_in_a_thread},
                       max_tokens=8)
    spun, slept, lent = (ticks[k]["cpu_ms"] for k in (1, 3, 5))
    assert spun[0] >= 25 and spun[1] >= spun[0]
    assert slept[0] < 10 and ticks[3]["tick_s"] >= 0.025
    assert lent[0] < 10 and lent[1] >= 25
    assert all(len(t["cpu_ms"]) == 3 and min(t["cpu_ms"]) >= 0 for t in ticks)


def test_trace_counts_the_caching_allocators_device_calls_in_their_tick(tiny_models, tmp_path, monkeypatch):
    """On CUDA, device memory allocated past the allocator's cache while one step is enqueued shows in that step's
    tick (`allocator`: retries, stream syncs, device allocations, device frees); on the CPU there is none to count."""
    import torch

    kept = []

    def allocate() -> None:
        if DEVICE != "cpu":
            torch.cuda.empty_cache()  # nothing cached to serve it: a device allocation of its own
            kept.append(torch.empty(96 << 20, dtype=torch.uint8, device=DEVICE))

    ticks = ticks_with(tiny_models, tmp_path, monkeypatch, {3: allocate}, max_tokens=6)
    assert len(ticks) >= 3
    if DEVICE == "cpu":
        assert all(t["allocator"] is None for t in ticks)
    else:
        assert len(ticks[2]["allocator"]) == 4 and ticks[2]["allocator"][2] >= 1
        assert all(n >= 0 for t in ticks for n in t["allocator"])


def test_itl_trace_flags_the_gap_whose_ticks_hold_an_allocators_device_call(tiny_models, tmp_path, monkeypatch):
    """A device allocation (or a free, a retry, a stream sync) counted in one tick flags the one gap whose window
    holds that tick, and no other."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    traced_run(tiny_models, path)
    trace = Trace(str(path))
    rid = next(rid for t in trace.ticks for rid, n in t["added"] if n == 3)
    reads = trace.token_ticks[rid]
    trace.ticks[reads[4]]["allocator"] = [0, 0, 1, 0]  # the tick that read its fifth token
    trace.ticks[reads[6]]["allocator"] = [0, 0, 0, 2]
    ends = [trace.sent(i) for i in reads]
    request = {"streams": 1, "prompt_len": 3, "start": ends[0] - 0.01, "first": ends[0],
               "after_us": [round(1e6 * (end - ends[0])) for end in ends]}
    gaps = gaps_of(request, rid, trace)
    assert [k for k, g in enumerate(gaps) if "a device allocation" in g.flags] == [3]
    assert [k for k, g in enumerate(gaps) if "an allocator retry, stream sync or device free" in g.flags] == [5]
