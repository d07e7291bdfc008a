"""The standard offline workloads (defined in docs/benchmarks.md), with random (dummy) weights.

    python benchmarks/offline.py --config .bench_models/qwen3-0.6b.json --workload w1 [--attn torch]
    python benchmarks/offline.py --config .bench_models/qwen3-8b-fp8.json --workload w2,w1   # one engine, both

Workloads: w1 (throughput), w2 (batch-1 decode latency), w3 / w3-nocache (shared prefix, radix or
naive cache), steps (decode step time at batch 1/8/32/128/256 over 512-token contexts).
Prints one JSON line per workload, with `ready_s`, the engine's start-up (weights, KV pool, CUDA graph
capture). Token ids in, token ids out: no tokenizer is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

Generate = Callable[[list[list[int]], float, list[int]], object]
"""Runs token-id prompts to completion (ignore_eos) at a temperature, each with its own max_tokens, and
returns once the device has finished. The workloads below take one, so that benchmarks/vllm_offline.py
drives vLLM through the same prompts, lengths and seeds."""


def model_dir(config: str) -> str:
    """A checkpoint directory holding only config.json, for dummy weights."""
    path = Path(tempfile.mkdtemp(prefix="minisgl-bench-"))
    shutil.copy(config, path / "config.json")
    return str(path)


def minisgl_generate(llm) -> Generate:
    """`Generate` over a minisgl LLM (imported here, so that the workloads load without minisgl)."""
    from minisgl import SamplingParams

    def generate(prompts: list[list[int]], temperature: float, max_tokens: list[int]) -> object:
        params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
        return llm.generate(prompts, params)  # returns host lists, so the device has finished

    return generate


def timed(generate: Generate, prompts: list[list[int]], temperature: float, max_tokens: int | list[int]) -> float:
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    start = time.perf_counter()
    generate(prompts, temperature, max_tokens)
    return time.perf_counter() - start


def w1(generate: Generate) -> dict:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    timed(generate, prompts[:4], 0.6, 16)
    seconds = timed(generate, prompts, 0.6, max_tokens)
    return {"workload": "W1", "seconds": round(seconds, 2), "output_tok_s": round(sum(max_tokens) / seconds)}


def decode_ms(generate: Generate, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """Median milliseconds per decode step: (time for `tokens` tokens - time for 1) / (tokens - 1)."""
    timed(generate, prompts, 0.0, 1)
    itl = [(timed(generate, prompts, 0.0, tokens) - timed(generate, prompts, 0.0, 1)) / (tokens - 1)
           for _ in range(repeats)]
    return round(1000 * statistics.median(itl), 3)


def w2(generate: Generate) -> dict:
    prompt = [random.Random(1).randint(0, 10000) for _ in range(128)]
    return {"workload": "W2", "itl_ms": decode_ms(generate, [prompt], 512, 5)}


def steps(generate: Generate) -> dict:
    rng = random.Random(2)
    out = {}
    for bs in (1, 8, 32, 128, 256):
        prompts = [[rng.randint(0, 10000) for _ in range(512)] for _ in range(bs)]
        out[f"bs{bs}_ms"] = decode_ms(generate, prompts, 65, 3)
    return {"workload": "steps", **out}


def w3(generate: Generate) -> dict:
    rng = random.Random(3)
    prefix = [rng.randint(0, 10000) for _ in range(2048)]
    suffixes = [[rng.randint(0, 10000) for _ in range(64)] for _ in range(65)]
    timed(generate, [prefix + suffixes[0]], 0.6, 128)
    seconds = timed(generate, [prefix + s for s in suffixes[1:]], 0.6, 128)
    return {"workload": "W3", "seconds": round(seconds, 3)}


WORKLOADS: dict[str, Callable[[Generate], dict]] = {"w1": w1, "w2": w2, "w3": w3, "w3-nocache": w3, "steps": steps}


def workload_list(value: str) -> list[str]:
    """--workload's value (here and in vllm_offline.py): one workload or several, comma-separated."""
    names = value.split(",")
    if unknown := sorted(set(names) - set(WORKLOADS)):
        raise argparse.ArgumentTypeError(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model config.json (e.g. a Hugging Face model's config.json)")
    parser.add_argument("--workload", required=True, type=workload_list,
                        help=f"one of {sorted(WORKLOADS)}, or several, comma-separated, run in that order on one "
                             "engine (w3 and w3-nocache not together)")
    parser.add_argument("--attn", default="auto", help="auto | torch | triton | PREFILL,DECODE")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256, help="0: no CUDA graphs")
    parser.add_argument("--no-overlap", action="store_true", help="disable overlap scheduling")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="auto: --dtype; fp8: a float8_e4m3fn KV cache")
    args = parser.parse_args()
    from minisgl import LLM
    from minisgl.kernels import native

    start = time.perf_counter()
    llm = LLM(model_dir(args.config), dtype=args.dtype, dummy_weights=True, attention_backend=args.attn,
              tp_size=args.tp, max_seq_len=4096, max_prefill_tokens=16384, max_running_requests=256,
              cache_type="naive" if "w3-nocache" in args.workload else "radix",
              cuda_graph_max_bs=args.cuda_graph_max_bs, overlap_schedule=not args.no_overlap,
              kv_cache_dtype=args.kv_cache_dtype)
    ready = time.perf_counter() - start
    kv_tokens = llm.engine.num_pages * llm.engine.page_size
    for workload in args.workload:  # each line printed as it comes: a later workload's failure keeps it
        result = WORKLOADS[workload](minisgl_generate(llm))
        if workload.startswith("w3"):
            result["cache"] = llm.engine.args.cache_type
        print(json.dumps({"model": Path(args.config).stem, "tp": args.tp, "attn": args.attn,
                          "graphs": args.cuda_graph_max_bs, "overlap": not args.no_overlap, "kv": args.kv_cache_dtype,
                          "kv_tokens": kv_tokens, "ready_s": round(ready, 1),
                          "native_gemv": os.environ.get("MINISGL_NATIVE_GEMV", "table"),
                          "csrc_built": native.library_path().exists(), **result}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
