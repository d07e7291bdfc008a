"""An A/B table from online.py's JSON lines: per model and level, each server's figure in run order, spec by spec,
and each spec's mean against the first spec's.

    python benchmarks/ab_table.py OUT/online.jsonl [MORE.jsonl ...]

Why: online tails vary by 10-20% from one server start to the next, so an A/B alternates servers (A B A B) and is
read server by server; a single median hides that spread. A server that ran a level several times (`--repeats`)
counts once, by its median row. Rows of servers online.py did not start (no `--serve`) are left out.
"""

from __future__ import annotations

import json
import statistics
import sys

FIGURES = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p99_ms", "ITL p99 ms"),
           ("output_tok_s", "output tok/s"))


def server_rows(lines: list[str]) -> list[dict]:
    """One row per server and level: the median row of a server's repeats, or its only row."""
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if "engine" in r and r.get("repeat", "median") == "median"]


def spec(row: dict) -> str:
    """The side_by_side.sh spec a row's server ran: ENGINE[:FLAGS], flags joined by commas."""
    flags = row.get("server_args", "").split()
    return row["engine"] + (":" + ",".join(flags) if flags else "")


def change(base: list[float], other: list[float]) -> str:
    return f"{100 * (statistics.mean(other) / statistics.mean(base) - 1):+.0f}%"


def table(rows: list[dict]) -> str:
    """Rows: model and streams. Cells: each spec's servers' figures in run order, specs split by " / ", then each
    later spec's mean against the first's."""
    groups: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["streams"]), {}).setdefault(spec(r), []).append(r)
    lines = []
    for model in dict.fromkeys(m for m, _ in groups):
        specs = list(dict.fromkeys(s for (m, _), by_spec in groups.items() if m == model for s in by_spec))
        lines += ["", f"{model}: " + " / ".join(specs), "",
                  "| streams | " + " | ".join(name for _, name in FIGURES) + " |", "|---|" + "---|" * len(FIGURES)]
        for (m, streams), by_spec in groups.items():
            if m != model:
                continue
            cells = []
            for key, _ in FIGURES:
                values = [[r[key] for r in by_spec.get(s, [])] for s in specs]
                cell = " / ".join(", ".join(f"{v:,}" for v in vs) or "-" for vs in values)
                if values[0] and any(values[1:]):
                    cell += " (" + ", ".join(change(values[0], vs) if vs else "-" for vs in values[1:]) + ")"
                cells.append(cell)
            lines.append(f"| {streams} | " + " | ".join(cells) + " |")
    return "\n".join(lines[1:])


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    lines = [line for path in sys.argv[1:] for line in open(path)]
    print(table(server_rows(lines)))


if __name__ == "__main__":
    main()
