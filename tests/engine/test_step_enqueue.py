"""benchmarks/step_enqueue.py on a tiny model: it finds mixed steps and times every stage of their enqueue."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_step_enqueue_times_the_stages_of_mixed_steps(tiny_models):
    device = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
    run = subprocess.run([sys.executable, "step_enqueue.py", "--model", tiny_models["qwen3"], "--decodes", "4",
                          "--prefill", "40", "--repeats", "3", "--device", device],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("2 mixed steps of 4 decodes + 40 prompt tokens")  # the first of 3 is left out
    rows = {line.split(" | ")[0][2:]: [float(v) for v in line.strip(" |").split(" | ")[1:]]
            for line in lines if line.startswith("| ") and not line.startswith("| stage")}
    assert set(rows) == {"extend_input", "whole-graph run", "prepare", "attention calls", "eager forward",
                         "last logits", "forward", "sample", "forward + sample"}
    mean = {stage: values[0] for stage, values in rows.items()}
    assert all(v >= 0 for v in mean.values()) and mean["forward"] > 0 and mean["sample"] > 0
    assert abs(mean["forward + sample"] - mean["forward"] - mean["sample"]) < 0.02
    assert mean["attention calls"] <= mean["forward"] and mean["extend_input"] <= mean["forward"]
