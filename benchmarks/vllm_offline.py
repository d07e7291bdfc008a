"""The peer's side of benchmarks/offline.py: the same workloads (prompts, lengths, seeds, timing) driven
through vLLM's offline `LLM`, with dummy weights from a directory holding only config.json.

    python benchmarks/vllm_offline.py --config .bench_models/qwen3-8b-fp8.json --workload w1|w2|w1,w2

An FP8 config carries its `quantization_config`, so vLLM builds its block-scaled FP8 model, as minisgl
does. Engine settings as vLLM's own defaults plus max_model_len 4096 and 85% of the GPU's memory. Prints
one JSON line per workload, as offline.py does; a comma list runs its workloads one after another on one
engine (vLLM's start-up is 1-3 minutes of device time). Run it in vLLM's environment; minisgl is not imported.

A MoE model's routers get spread weights before the workloads run (`spread_routers`; `--vllm-router` keeps
vLLM's own). Why: vLLM's dummy weights are uniform in [-0.001, 0.001], and under an FP8 `quantization_config` it
quantizes the router too; e4m3 rounds 98% of those weights to zero, and the router's logits come out ~1e-9 apart.
qwen3-30b-a3b FP8's W1 on an H100 then spent 1.9 s in vLLM's fused-MoE kernel and ran at 9,074 tok/s, against
10.9 s and 6,469 tok/s with spread routers: its steps read far fewer experts' weights than a trained model's do.
minisgl's dummy routers (normal(0, 0.02), bf16) spread tokens over every expert.
"""

from __future__ import annotations

import argparse
import json
import os
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


def spread_routers(model) -> int:
    """Give every MoE router (`mlp.gate`) weights of normal(0, 0.02), as minisgl's dummy routers have: standard
    normal values under scales of 0.02 where the router is FP8. Runs in vLLM's worker (`apply_model`);
    returns how many routers it set."""
    import torch

    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not name.endswith("mlp.gate"):
                continue
            weight = module.weight
            scales = [getattr(module, s) for s in ("weight_scale_inv", "weight_scale") if hasattr(module, s)]
            values = torch.randn(weight.shape, device=weight.device).clamp(-4, 4)
            weight.copy_((values if scales else values * 0.02).to(weight.dtype))
            for scale in scales:
                scale.fill_(0.02)
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model config.json (e.g. .bench_models/*.json)")
    parser.add_argument("--workload", required=True, type=workload_list,
                        help=f"one of {sorted(WORKLOADS)}, or several, comma-separated")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--vllm-router", action="store_true",
                        help="keep the MoE routers of vLLM's dummy weights (see above: most tokens to a few experts)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends spread_routers to the worker
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(model=model_dir(args.config), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                   gpu_memory_utilization=0.85, tensor_parallel_size=args.tp,
                   enable_prefix_caching="w3-nocache" not in args.workload)
    ready = time.perf_counter() - start
    routers = "vllm" if args.vllm_router else f"spread ({sum(llm.apply_model(spread_routers))})"
    for workload in args.workload:
        result = WORKLOADS[workload](vllm_generate(llm))
        print(json.dumps({"engine": f"vllm {vllm.__version__}", "model": Path(args.config).stem, "tp": args.tp,
                          "ready_s": round(ready, 1), "routers": routers, **result}), flush=True)


if __name__ == "__main__":
    main()
