"""Turn load-test runs into a table and a plot of latency percentiles against load.

    python loadtest/report.py out/u1 out/u16 out/u64 --slo ttft:500ms,tpot:50ms --out out/report

Each argument is the `--csv` prefix of one locust run of locustfile.py (one load level): report.py reads its
`PREFIX_llm_requests.csv` (one row per request) and `PREFIX_llm_run.json` (settings and wall time), prints a
Markdown table and writes `report.md`, `report.json` and `latency.png` (matplotlib; `--no-plot` skips it, as in
the stock Locust image). Definitions as vLLM's `bench serve`: see stream_metrics.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

from stream_metrics import PERCENTILES, RunSummary, parse_slo, read_records, summarize

METRICS = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E"}


@dataclass
class Run:
    prefix: str
    users: int
    request_rate: float  # 0: closed loop
    summary: RunSummary
    errors: dict[str, int]  # error message -> count

    @property
    def load(self) -> str:
        if self.request_rate:
            return f"{self.request_rate:g} req/s"
        return f"{self.users} user" + ("s" if self.users != 1 else "")


def load_run(prefix: str, slo: dict[str, float]) -> Run:
    try:
        with open(f"{prefix}_llm_run.json") as f:
            info = json.load(f)
        records = read_records(f"{prefix}_llm_requests.csv")
    except FileNotFoundError as exc:
        raise SystemExit(f"report.py: {exc.filename} is missing: was the run made with --csv {prefix} "
                         "and did it finish?") from None
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    summary = summarize(records, info["stop"] - info["start"], slo)
    return Run(prefix, info["users"], info["workload"]["request_rate"], summary, errors)


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def table(runs: list[Run], slo: dict[str, float]) -> str:
    percentiles = "/".join(f"p{q}" for q in PERCENTILES)
    goodput = "goodput req/s (" + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items()) + ")" if slo else "goodput"
    header = ["load", "ok", "failed", "prompt / output tok", "req/s", "output tok/s", goodput,
              *(f"{label} {percentiles} ms" for label in METRICS.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        s = run.summary
        cells = [run.load, str(s.completed), str(s.failed), f"{s.mean_prompt_tokens:.0f} / {s.mean_output_tokens:.0f}",
                 fmt(s.request_throughput), fmt(s.output_throughput), fmt(s.goodput),
                 *(" / ".join(fmt(s.latency_ms[m][q]) for q in PERCENTILES) for m in METRICS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: str) -> None:
    """Latency percentiles and throughput against load, one evenly spaced point per run, labelled with its load
    (users for closed loop, request rate for open loop)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(runs)))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (metric, label) in zip(axes.flat, METRICS.items()):
        for q, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            ys = [run.summary.latency_ms[metric][q] for run in runs]
            ax.plot(x, [math.nan if y is None else y for y in ys], style, label=f"p{q}")
        ax.set_title(f"{label} (ms)")
        ax.set_yscale("log")
    for ax, (field, label) in zip(axes.flat[4:], [("output_throughput", "output tokens/s"),
                                                 ("request_throughput", "requests/s")]):
        ax.plot(x, [getattr(run.summary, field) for run in runs], "o-", label=label)
        if field == "request_throughput" and runs[0].summary.goodput is not None:
            ax.plot(x, [run.summary.goodput for run in runs], "s--", label="goodput")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
    for ax in axes.flat:
        ax.set_xticks(x, [run.load for run in runs])
        ax.set_xlabel("load")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def warnings(runs: list[Run]) -> list[str]:
    notes = []
    for run in runs:
        if run.summary.completed and run.summary.mean_output_tokens > 1 and run.summary.latency_ms["itl"][50] is None:
            notes.append(f"{run.load}: no ITL samples although answers have several tokens: the server sent each "
                         "answer in one chunk (a server without a tokenizer must stream token_ids)")
        for message, count in sorted(run.errors.items(), key=lambda item: -item[1])[:5]:
            notes.append(f"{run.load}: {count} × {message}")
    return notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="+", help="the --csv prefix of each run, in order of load")
    parser.add_argument("--slo", default="", help="goodput SLOs, e.g. ttft:500ms,tpot:50ms,e2e:10s")
    parser.add_argument("--out", default=".", help="folder for report.md, report.json and latency.png")
    parser.add_argument("--no-plot", action="store_true", help="table only (no matplotlib needed)")
    args = parser.parse_args(argv)
    try:
        slo = parse_slo(args.slo)
    except ValueError as exc:
        parser.error(str(exc))
    runs = [load_run(prefix, slo) for prefix in args.prefixes]
    os.makedirs(args.out, exist_ok=True)
    text = table(runs, slo)
    notes = warnings(runs)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "".join(f"\n- {note}" for note in notes) + ("\n" if notes else ""))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"slo_ms": slo, "runs": [asdict(run) for run in runs]}, f, indent=1)
    if not args.no_plot:
        plot(runs, os.path.join(args.out, "latency.png"))
    print(text, end="")
    for note in notes:
        print("note:", note, file=sys.stderr)


if __name__ == "__main__":
    main()
