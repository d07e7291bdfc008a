"""benchmarks/online.py against a real server: a level whose requests fail says so under its table, with the
server's error (its timings alone would be empty: NaN percentiles, 0 tok/s); repeated runs of a level draw prompts
of their own and end in a row of their medians."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from server_fixtures import Server

ROOT = Path(__file__).resolve().parents[2]


def test_failed_requests_are_reported_under_the_table():
    srv = Server("--demo")
    try:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks/online.py"), "--url", srv.url, "--model", "demo",
                              "--levels", "2", "--rounds", "1", "--max-tokens", "4", "--prompt-len", "8,16",
                              "--max-id", "10000000", "--clients", "1"],  # ids past the demo model's vocabulary
                             check=True, capture_output=True, text=True, timeout=300).stdout
    finally:
        assert srv.stop() == 0
    failed = [line for line in out.splitlines() if "requests failed" in line]
    assert failed == [failed[0]] and failed[0].startswith("2 streams: 2 of 2 requests failed (first: 400: ")
    assert "out of vocabulary" in failed[0]


def test_repeats_draw_their_own_prompts_and_end_in_their_medians(tmp_path):
    srv = Server("--demo")
    requests, rows = tmp_path / "requests.jsonl", tmp_path / "rows.jsonl"
    try:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks/online.py"), "--url", srv.url, "--model", "demo",
                              "--levels", "2", "--rounds", "2", "--repeats", "3", "--max-tokens", "4", "--prompt-len",
                              "8,64", "--max-id", "200", "--clients", "1", "--requests-out", str(requests), "--json",
                              str(rows)], check=True, capture_output=True, text=True, timeout=300).stdout
    finally:
        assert srv.stop() == 0
    runs = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["repeat"] for r in runs] == [0, 1, 2, "median"] and not any(r["errors"] for r in runs)
    median = runs[-1]
    assert median["requests"] == 12 and median["streams"] == 2
    for key in ("ttft_p50_ms", "itl_p99_ms", "output_tok_s"):
        assert median[key] == round(statistics.median(r[key] for r in runs[:3]), 2)
    lengths = [line["prompt_len"] for line in map(json.loads, requests.read_text().splitlines())]
    assert len(lengths) == 12 and len({tuple(sorted(lengths[k:k + 4])) for k in range(0, 12, 4)}) == 3
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| 2 (")] == \
        ["| 2 (0)", "| 2 (1)", "| 2 (2)", "| 2 (median)"]
