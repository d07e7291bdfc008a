"""Turn offline.py's JSON lines into one table with the ratio to vLLM (docs/benchmarks.md's figures).

    python benchmarks/summary.py bench.jsonl
"""

from __future__ import annotations

import json
import sys

# vLLM 0.26.0 on one H200, dummy weights, same workloads (docs/benchmarks.md).
VLLM = {
    ("qwen3-0.6b", "W1"): 23232, ("qwen3-0.6b", "W2"): 1.64,
    ("qwen3-8b", "W1"): 9086, ("qwen3-8b", "W2"): 5.19,
    ("llama-3.1-8b", "W1"): 9592, ("llama-3.1-8b", "W2"): 4.90,
    ("qwen3-30b-a3b", "W1"): 5790, ("qwen3-30b-a3b", "W2"): 4.15,
    ("qwen3-0.6b", "W3"): 0.627, ("qwen3-8b", "W3"): 1.297,
}


def row(r: dict) -> tuple[str, str, str, str]:
    name = f"{r['model']} tp{r.get('tp', 1)}" + ("" if r.get("overlap", True) else " no-overlap") + (
        "" if r.get("graphs", 1) else " no-graphs") + ("" if r.get("kv", "auto") == "auto" else f" kv-{r['kv']}")
    if "error" in r:
        return name, r["workload"], "error", ""
    wl = r["workload"]
    peer = VLLM.get((r["model"], wl))
    if wl == "W1":
        ratio = f"{r['output_tok_s'] / peer:.2f}x" if peer else ""
        return name, wl, f"{r['output_tok_s']:,} tok/s ({r['seconds']} s)", ratio
    if wl == "W2":
        return name, wl, f"{r['itl_ms']} ms/token", f"{r['itl_ms'] / peer:.2f}x time" if peer else ""
    if wl == "W3":
        vllm = f"{r['seconds'] / peer:.2f}x time" if peer and r["cache"] == "radix" else ""
        return name, f"W3 {r['cache']}", f"{r['seconds']} s", vllm
    if wl == "W1-structured":
        return name, wl, f"{r['json_schema_tok_s']:,} vs {r['free_tok_s']:,} tok/s free", f"{r['ratio']}x"
    return name, wl, " ".join(f"{k[:-3]}={v}ms" for k, v in r.items() if k.endswith("_ms")), ""


def main(path: str) -> None:
    rows = [row(json.loads(line)) for line in open(path) if line.strip()]
    print(f"{'model':<28} {'workload':<10} {'result':<44} {'vs vLLM':<10}")
    for name, wl, result, ratio in rows:
        print(f"{name:<28} {wl:<10} {result:<44} {ratio:<10}")
    ready = {f"{r['model']} tp{r['tp']}": r["ready_s"] for r in map(json.loads, open(path)) if "ready_s" in r}
    print("engine start-up (weights, KV pool, CUDA graphs):", ", ".join(f"{k} {v} s" for k, v in ready.items()))


if __name__ == "__main__":
    main(sys.argv[1])
