"""The standard offline workloads of shared/bench/WORKLOADS.md, with random (dummy) weights.

    python benchmarks/offline.py --config ../shared/models/qwen3-0.6b.json --workload w1 [--attn torch]

Prints one JSON line per workload. Token ids in, token ids out: no tokenizer is needed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from minisgl import LLM, SamplingParams


def model_dir(config: str) -> str:
    """A checkpoint directory holding only config.json, for dummy weights."""
    path = Path(tempfile.mkdtemp(prefix="minisgl-bench-"))
    shutil.copy(config, path / "config.json")
    return str(path)


def timed(llm: LLM, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)  # returns host lists, so the device has finished
    return time.perf_counter() - start


def w1(llm: LLM) -> dict:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    timed(llm, prompts[:4], SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True))
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    seconds = timed(llm, prompts, params)
    return {"workload": "W1", "seconds": round(seconds, 2), "output_tok_s": round(sum(max_tokens) / seconds)}


def w2(llm: LLM) -> dict:
    prompt = [random.Random(1).randint(0, 10000) for _ in range(128)]
    one, many = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 512))
    timed(llm, [prompt], one)
    itl = [(timed(llm, [prompt], many) - timed(llm, [prompt], one)) / 511 for _ in range(5)]
    return {"workload": "W2", "itl_ms": round(1000 * statistics.median(itl), 3)}


def w3(llm: LLM) -> dict:
    rng = random.Random(3)
    prefix = [rng.randint(0, 10000) for _ in range(2048)]
    suffixes = [[rng.randint(0, 10000) for _ in range(64)] for _ in range(65)]
    params = SamplingParams(temperature=0.6, max_tokens=128, ignore_eos=True)
    timed(llm, [prefix + suffixes[0]], params)
    seconds = timed(llm, [prefix + s for s in suffixes[1:]], params)
    return {"workload": "W3", "cache": llm.engine.args.cache_type, "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model config.json (e.g. ../shared/models/*.json)")
    parser.add_argument("--workload", choices=["w1", "w2", "w3", "w3-nocache"], required=True)
    parser.add_argument("--attn", default="torch")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(model_dir(args.config), dtype=args.dtype, dummy_weights=True, attention_backend=args.attn,
              max_seq_len=4096, max_prefill_tokens=16384, max_running_requests=256,
              cache_type="naive" if args.workload == "w3-nocache" else "radix")
    run = {"w1": w1, "w2": w2, "w3": w3, "w3-nocache": w3}[args.workload]
    print(json.dumps({"model": Path(args.config).stem, "attn": args.attn, **run(llm)}), flush=True)


if __name__ == "__main__":
    main()
