"""benchmarks/step_summary.py on a traced run: every step of the last generate counted, its tokens accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from minisgl import LLM, SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")


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
