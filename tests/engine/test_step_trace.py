"""MINISGL_STEP_TRACE: the scheduler's per-tick trace shows each request's arrival, chunks and first token."""

from __future__ import annotations

import json
import os

from minisgl import LLM, SamplingParams

DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")


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
    ticks = ticks[next(i for i, t in enumerate(ticks) if any(rid >= 0 for rid, _ in t["added"])):]  # after warm-up
    rids = {n: rid for rid, n in ticks[0]["added"]}
    assert set(rids) == {3, 40} and all(t["t"] <= u["t"] for t, u in zip(ticks, ticks[1:]))
    chunks = [n for t in ticks for rid, n in t["chunks"] if rid == rids[40]]
    assert sum(chunks) == 40 and max(chunks) <= 16 and len(chunks) >= 3  # chunked within the budget
    first = [k for k, t in enumerate(ticks) if rids[40] in t["first"]]
    last_chunk = max(k for k, t in enumerate(ticks) if rids[40] in (rid for rid, _ in t["chunks"]))
    assert len(first) == 1 and first[0] > last_chunk  # read once, after its last chunk was launched
    assert len(short.token_ids) == len(long.token_ids) == 3
