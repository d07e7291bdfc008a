"""benchmarks/step_summary.py on a traced run: every step of the last generate counted, its tokens accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import DEVICE

from minisgl import LLM, SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_step_summary_accounts_for_every_step_of_the_last_generate(tiny_models, tmp_path, monkeypatch):
    """A first generate (a workload's warm-up), then the one summarized: --since-last-arrival keeps its steps only;
    their prefill tokens are its prompts' (chunked by a 16-token budget), their decodes its tokens after the first."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(path))
    llm = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", num_pages=1024, cuda_graph_max_bs=8,
              max_prefill_tokens=16)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        outs = llm.generate([list(range(10, 50)), [5, 6, 7, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    finally:
        llm.shutdown()
    run = subprocess.run([sys.executable, "step_summary.py", str(path), "--since-last-arrival"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    rows = [line.strip("|").split(" | ") for line in lines if line.startswith("| ") and not line.startswith("| kind")]
    ticks = [json.loads(line) for line in path.read_text().splitlines()]
    last_arrival = max(i for i, tick in enumerate(ticks) if tick["added"])
    steps = sum(tick["step"] is not None for tick in ticks[last_arrival:])
    assert sum(int(row[3]) for row in rows) == steps  # every step in one group
    assert {row[1].strip() for row in rows} <= {"decode", "prefill", "mixed"}
    decodes = sum(len(out.token_ids) - 1 for out in outs)
    assert lines[-1].startswith(f"{steps} steps, {decodes} decode and 44 prefill tokens; wall span ")
    if DEVICE == "cpu":  # no step cost model, no device time: no ratio
        assert {row[-1].strip() for row in rows} == {"-"}


def test_a_groups_device_time_is_set_against_the_models_estimate_of_it(tmp_path):
    """Two mixed steps that took 1.5x and 1.1x their estimates (6 + 11 ms against 4 + 10) read 17 / 14 = 1.21x."""
    sys.path.insert(0, str(BENCHMARKS))
    from step_summary import read_steps, summarize

    base = {"build_s": 0.001, "launch_s": 0.002, "added": [], "kind": "whole", "decodes": 40, "read": None}
    lines = [{**base, "t": 1.0, "step": 0, "chunks": [[7, 500]], "model_ms": 4.0},
             {**base, "t": 1.01, "step": 1, "chunks": [[7, 300]], "model_ms": 10.0, "read": 0, "device_ms": 6.0,
              "read_s": 0.003},
             {**base, "t": 1.02, "step": None, "chunks": [], "read": 1, "device_ms": 11.0, "read_s": 0.001}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = [line for line in summarize(*read_steps(path)).splitlines() if line.startswith("| whole")]
    assert len(rows) == 1 and rows[0].rstrip(" |").endswith("| 1.21")
