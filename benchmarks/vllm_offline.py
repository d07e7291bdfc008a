"""The peer's side of benchmarks/offline.py: the same workloads (prompts, lengths, seeds, timing) driven
through vLLM's offline `LLM`, with dummy weights from a directory holding only config.json.

    python benchmarks/vllm_offline.py --config .bench_models/qwen3-8b-fp8.json --workload w1|w2|w1,w2

An FP8 config carries its `quantization_config`, so vLLM builds its block-scaled FP8 model, as minisgl
does. Engine settings as vLLM's own defaults plus max_model_len 4096 and 85% of the GPU's memory. Prints
one JSON line per workload, as offline.py does; a comma list runs its workloads one after another on one
engine (vLLM's start-up is 1-3 minutes of device time). Run it in vLLM's environment; minisgl is not imported.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from offline import WORKLOADS, Generate, model_dir, workload_list


def vllm_generate(llm) -> Generate:
    """`Generate` over a vLLM LLM: token-id prompts, one SamplingParams per prompt."""
    from vllm import SamplingParams

    def generate(prompts: list[list[int]], temperature: float, max_tokens: list[int]) -> object:
        params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model config.json (e.g. .bench_models/*.json)")
    parser.add_argument("--workload", required=True, type=workload_list,
                        help=f"one of {sorted(WORKLOADS)}, or several, comma-separated")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(model=model_dir(args.config), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                   gpu_memory_utilization=0.85, tensor_parallel_size=args.tp,
                   enable_prefix_caching="w3-nocache" not in args.workload)
    ready = time.perf_counter() - start
    for workload in args.workload:
        result = WORKLOADS[workload](vllm_generate(llm))
        print(json.dumps({"engine": f"vllm {vllm.__version__}", "model": Path(args.config).stem, "tp": args.tp,
                          "ready_s": round(ready, 1), **result}), flush=True)


if __name__ == "__main__":
    main()
