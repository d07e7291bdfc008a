"""benchmarks/online.py against a real server: a level whose requests fail says so under its table, with the
server's error (its timings alone would be empty: NaN percentiles, 0 tok/s)."""

from __future__ import annotations

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
