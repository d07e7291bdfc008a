"""MINISGL_STEP_TRACE end to end: a real `python -m minisgl --demo` server traced, the real closed-loop client
(benchmarks/online.py --requests-out), and benchmarks/itl_trace.py's join of the two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server_fixtures import Server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from itl_trace import PARTS, Trace, gaps_of  # noqa: E402
from ttft_trace import json_lines, match_requests  # noqa: E402

MAX_TOKENS = 12


def test_every_chunk_joins_the_server_trace(tmp_path, monkeypatch):
    """Each request the client timed is found in the scheduler's trace; each of its tokens was read by one tick,
    passed the detokenizer and the API process once, in that order, before the client had it; every gap's parts
    add up to it; the analyzer prints a table for the level."""
    trace_path, requests_path = tmp_path / "trace.jsonl", tmp_path / "requests.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(trace_path))  # the server's processes inherit it
    srv = Server("--demo")
    try:
        subprocess.run([sys.executable, str(ROOT / "benchmarks/online.py"), "--url", srv.url, "--model", "demo",
                        "--levels", "4", "--rounds", "2", "--max-tokens", str(MAX_TOKENS), "--prompt-len", "8,40",
                        "--max-id", "500", "--clients", "1", "--requests-out", str(requests_path)],
                       check=True, capture_output=True, timeout=300)
    finally:
        assert srv.stop() == 0
    trace = Trace(str(trace_path))
    matched = match_requests(json_lines(str(requests_path)), trace.ticks)
    assert len(matched) == 8
    for req, rid, _ in matched:
        ticks = trace.token_ticks[rid]
        assert req["tokens"] == len(ticks) == MAX_TOKENS
        detok, api = trace.passed["detok"][rid], trace.passed["api"][rid]
        assert len(detok) == len(api) == MAX_TOKENS
        arrivals = [req["first"] + us / 1e6 for us in req["after_us"]]
        last = [sum((req.get("n") or [1] * len(arrivals))[:k + 1]) - 1 for k in range(len(arrivals))]
        for k, token in enumerate(last):  # each chunk's last token: scheduler -> detokenizer -> API -> client
            assert trace.sent(ticks[token]) <= detok[token] <= api[token] <= arrivals[k]
        gaps = gaps_of(req, rid, trace)
        assert len(gaps) == len(arrivals) - 1
        for k, gap in enumerate(gaps, start=1):
            assert abs(sum(gap.parts.values()) - gap.ms) < 0.01
            # The scheduler thread's CPU time fits in the scheduler's part of the gap, the time between the two
            # ticks' sends. The counters are read at each tick's end, before its outputs are gathered and sent, so
            # they may also hold the earlier tick's gathering. (Its run-queue wait is not held to that bound: on a
            # loaded 2-core machine, CPU time and wait together exceeded the window by a few ms in some gaps.)
            scheduler_ms = sum(gap.parts[part] for part in PARTS if part not in ("detok", "api", "to_client"))
            earlier = trace.ticks[ticks[last[k - 1]]]
            gathering_ms = 1000 * (trace.sent(ticks[last[k - 1]]) - earlier["t"] - earlier["tick_s"])
            assert 0 < gap.thread_cpu_ms <= scheduler_ms + gathering_ms + 0.1 and gap.run_queue_ms >= 0
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/itl_trace.py"), str(requests_path),
                          str(trace_path)], check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("### 4 streams: ") and "| device decode |" in out
    assert "the scheduler thread in a gap's ticks, mean: on a core" in out
