"""After the start-up warm-up, serving compiles no Triton kernel.

Triton compiles a kernel variant the first time a launch needs it (a new tile config, a new value class of a
specialized argument): seconds in the middle of somebody's request. The warm-up must cover what real traffic
launches. Each case runs in a fresh process, because Triton's in-memory kernel cache is process-wide and other
tests of the session would have compiled variants already. Tiny models reach only the small rows of the measured
kernel tables, so real models' widths (with two layers, random weights) are served too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import DEVICE

# W1-like traffic (random prompt and answer lengths, sampled, one big batch whose prefill is chunked), then
# W3-like (an odd number of requests extending a shared prefix), then greedy batches of odd sizes. With the
# default CUDA graphs (up to batch 256, the default limit of running requests) every decode replays a graph.
SCRIPT = """
import json, random, sys
from triton import knobs
from minisgl import LLM, SamplingParams

llm = LLM(sys.argv[1], device=sys.argv[2], dtype="bfloat16", num_pages=32768, cache_type=sys.argv[3],
          dummy_weights=sys.argv[4] == "dummy", max_prefill_tokens=int(sys.argv[5]))
compiled = []
knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: compiled.append(fn.name)
rng = random.Random(0)
vocab = llm.engine.config.vocab_size
prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
lengths = [rng.randint(1, 1500) for _ in range(40)]
llm.generate([prompt(n) for n in lengths],
             [SamplingParams(temperature=0.6, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in lengths])
prefix = prompt(700)
llm.generate([prefix + prompt(rng.randint(1, 64)) for _ in range(33)],
             SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True))
for batch in (33, 47):
    llm.generate([prompt(rng.randint(1, 300)) for _ in range(batch)],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
llm.shutdown()
print(json.dumps(compiled))
"""


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Qwen3-8B's and Qwen3-30B-A3B's widths (their config.json but for the layer count): the shapes that key the FP8
# GEMM, GEMV, cuBLAS and fused-MoE tables.
REAL_WIDTHS = {
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4},
}


def serve(model: str, cache_type: str, weights: str, budget: int = 8192) -> list[str]:
    """The kernels compiled while SCRIPT serves `model` after its warm-up, in a fresh process, under a token budget
    of `budget` a step."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, DEVICE, cache_type, weights, str(budget)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_serving_compiles_nothing_after_the_warm_up(tiny_models, arch, cache_type):
    assert serve(tiny_models[arch], cache_type, "checkpoint") == []


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("model", REAL_WIDTHS)
def test_real_widths_compile_nothing_after_the_warm_up(tmp_path, model, fp8):
    """Prompts of every length up to 1,500 reach each table row a real model's widths take; Triton also
    specializes integer arguments on their divisibility by 16, which the warm-up's prompt lengths must cover. W1's
    budget of 16,384 tokens a step: steps beyond the prefill graphs' 8,192 tokens run eagerly at any token count
    (an odd one compiled qwen3-30b-a3b's FP8 expert kernels again before dbeda06)."""
    config = {**REAL_WIDTHS[model], "num_hidden_layers": 2, "head_dim": 128, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960, "vocab_size": 151936,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
    if fp8:
        config["quantization_config"] = FP8_BLOCKS
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert serve(str(tmp_path), "radix", "dummy", budget=16384) == []
