"""Greedy tokens of a real config (dummy weights, bf16) at TP=2 against TP=1 (needs two GPUs).

    python benchmarks/tp_greedy.py --config .bench_models/qwen3-30b-a3b.json

The two all-reduce their partial sums in a different order, so bf16 logits differ by rounding: tokens
must agree up to the first step where TP=1's two best tokens nearly tie. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random

import torch
from offline import model_dir

from minisgl import LLM, SamplingParams

NEAR_TIE = 0.05  # nats


def greedy(path: str, tp: int, prompts: list[list[int]], tokens: int, graphs: int):
    llm = LLM(path, dtype="bfloat16", dummy_weights=True, tp_size=tp, max_seq_len=4096, memory_ratio=0.8,
              cuda_graph_max_bs=graphs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2))
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256)
    args = parser.parse_args()
    rng = random.Random(5)
    prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in (5, 60, 300, 1000)]
    path = model_dir(args.config)
    one, two = (greedy(path, tp, prompts, args.tokens, args.cuda_graph_max_bs) for tp in (1, 2))
    compared, mismatches = 0, []
    for i, (a, b) in enumerate(zip(one, two)):
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            compared += 1
            if x.token_id != y.token_id:
                mismatches.append((i, step))
                break
            if x.top[0][1] - x.top[1][1] < NEAR_TIE:
                break
    equal = [a.token_ids == b.token_ids for a, b in zip(one, two)]
    print(json.dumps({"tp_greedy": args.config.split("/")[-1], "tokens_compared": compared,
                      "mismatches": mismatches, "equal_tokens": equal}))


if __name__ == "__main__":
    main()
