"""benchmarks/ab_table.py: an A/B read server by server, from online.py's rows (a server's repeats count once, by
their median row), each later spec's mean against the first's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from ab_table import server_rows, table  # noqa: E402
from online import median_row  # noqa: E402


def server(args: str, streams: int, ttft_p50: list[float], tok_s: int = 4900) -> list[dict]:
    """A started server's rows for one level, as online.py appends them: each repeat's, then their median."""
    tag = {"engine": "minisgl", "model": "qwen3-8b", "server_args": args}
    runs = [{**tag, "streams": streams, "ttft_p50_ms": t, "ttft_p99_ms": 1100.0, "itl_p99_ms": 40.0,
             "output_tok_s": tok_s, "requests": 128, "errors": 0, "repeat": k} for k, t in enumerate(ttft_p50)]
    return [*runs, median_row(runs)]


def test_servers_in_run_order_spec_by_spec_with_the_change_of_the_means():
    rows = [*server("", 64, [340.0, 342.2]), *server("--schedule-policy fcfs", 64, [430.0, 435.6]),
            *server("", 64, [360.0, 369.2]), *server("--schedule-policy fcfs", 64, [510.0, 520.6]),
            *server("", 16, [150.0, 152.0], tok_s=1926),
            {"streams": 64, "ttft_p50_ms": 1.0, "repeat": "median"}]  # a server online.py did not start: left out
    lines = table(server_rows([json.dumps(r) for r in rows])).splitlines()
    assert lines[0] == "qwen3-8b: minisgl / minisgl:--schedule-policy,fcfs"
    sixty_four = next(line for line in lines if line.startswith("| 64 |")).split(" | ")
    # medians 341.1 and 364.6 against 432.8 and 515.3: means 352.85 and 474.05, +34%
    assert sixty_four[1] == "341.1, 364.6 / 432.8, 515.3 (+34%)"
    assert sixty_four[2] == "1,100.0, 1,100.0 / 1,100.0, 1,100.0 (+0%)"
    assert next(line for line in lines if line.startswith("| 16 |")).split(" | ")[1:] == \
        ["151.0 / -", "1,100.0 / -", "40.0 / -", "1,926 / - |"]
