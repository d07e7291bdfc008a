"""Write a tiny random-weight Hugging Face checkpoint (tokenizer, config, safetensors) with no network.

Tests use it as the oracle's model and the README uses it for a first run on a CPU machine.
Usage: python -m minisgl.tools.tiny_model OUT_DIR --arch qwen3 [--seed 0] [--max-shard-size 200KB] [--fp8 32]

--fp8 B writes the layout of the Hugging Face FP8 checkpoints (Qwen/Qwen3-8B-FP8) with B x B weight blocks:
e4m3 projection weights, float32 `weight_scale_inv` per block, everything else in the model dtype, and
the `quantization_config` that marks them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from minisgl.layers.fp8 import quantize_weight
from minisgl.quantization import Fp8Config

ARCHS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's template in small: shows tools to the model, renders earlier tool calls and tool results, and opens
# or closes a `<think>` block (enable_thinking). What --demo serves, so tool calling works there as on Qwen3.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif force_thinking is defined and force_thinking %}<think>
{% endif %}{% endif %}"""
VOCAB_TARGET = 500
# Init scales (weight std = GAIN / sqrt(fan_in)), tuned so greedy top-1/top-2 logit gaps are ~0.6 median and
# rarely below 1e-3, while the layers outweigh the input embedding (else tied qwen3 just repeats its input).
EMBED_STD, LINEAR_GAIN, LM_HEAD_GAIN, ROUTER_GAIN, NORM_NOISE, BIAS_STD = 0.5, 2.5, 3.0, 4.0, 0.1, 0.1
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small model can still tell a story: once upon a time, "
    "there was a little robot who wanted to learn how to read. Every morning it opened a new book, "
    "counted the words, and wrote down the ones it did not know.",
    "Inference engines batch many requests together. The scheduler decides which requests run next, the "
    "cache keeps the keys and values of earlier tokens, and the sampler turns logits into the next token. "
    "Prefill processes the prompt; decode produces one token per step until a stop condition is reached.",
    "What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany. "
    "The weather today is sunny with a light breeze; tomorrow it may rain in the afternoon.",
    "def fibonacci(n: int) -> list[int]:\n    values = [0, 1]\n    for i in range(2, n):\n"
    "        values.append(values[i - 1] + values[i - 2])\n    return values[:n]\n",
    "class Request:\n    def __init__(self, prompt, max_tokens=16):\n        self.prompt = prompt\n"
    "        self.output = []\n\n    def is_finished(self) -> bool:\n"
    "        return len(self.output) >= self.max_tokens\n",
    "for (int i = 0; i < size; ++i) { sum += data[i] * weight[i]; }\nreturn sum / (float)size;\n",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 42 100 3.14 2024-01-01 #include <stdio.h> "
    "x = {\"key\": \"value\", \"list\": [1, 2, 3]}; if (a && b || !c) { print(\"hello, world!\"); }",
    "User: Can you help me write a function?\nAssistant: Of course! Tell me what the function should do, "
    "which inputs it takes, and what it should return. Then we can write it together, step by step.",
]


def train_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the fixed corpus: every byte is in the vocab, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=chat_template)


def build_config(arch: str, tokenizer: PreTrainedTokenizerFast, **overrides) -> PretrainedConfig:
    """A tiny config of the real class, with each architecture's distinctive feature switched on."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    kwargs = dict(
        vocab_size=math.ceil(len(tokenizer) / 64) * 64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    if arch == "llama":  # rope_scaling is converted to rope_parameters by transformers 5
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    elif arch == "qwen3":
        kwargs["tie_word_embeddings"] = True
    elif arch == "qwen3_moe":
        kwargs.update(num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=1, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return ARCHS[arch](**{**kwargs, **overrides})


@torch.no_grad()
def reinit_weights(model: torch.nn.Module) -> None:
    """Replace HF's std-0.02 init, whose near-flat logits make greedy ties (and flaky comparisons) common.

    Norm weights and biases get noise so that mishandling them visibly changes the output; the MoE
    router is sharper so that expert choice is decisive.
    """
    for name, param in model.named_parameters():  # tied lm_head shares embed_tokens and is listed once
        if name.endswith("bias"):
            param.normal_(0.0, BIAS_STD)
        elif "norm" in name:
            param.copy_(1.0 + NORM_NOISE * torch.randn_like(param))
        elif "embed_tokens" in name:
            param.normal_(0.0, EMBED_STD)
        elif name.endswith("mlp.gate.weight"):
            param.normal_(0.0, ROUTER_GAIN / math.sqrt(param.shape[-1]))
        elif name == "lm_head.weight":
            param.normal_(0.0, LM_HEAD_GAIN / math.sqrt(param.shape[-1]))
        else:  # Linear [out, in] and fused expert [experts, out, in] weights: fan_in is the last dim
            param.normal_(0.0, LINEAR_GAIN / math.sqrt(param.shape[-1]))


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", seed: int = 0,
                    max_shard_size: str | None = None, chat_template: str = CHAT_TEMPLATE,
                    fp8_block: int | None = None, **config_overrides) -> Path:
    """Write a loadable tiny checkpoint to out_dir; the same arguments always give the same files.
    fp8_block: quantize its projections to FP8 with blocks of fp8_block x fp8_block weights."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(chat_template)
    config = build_config(arch, tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_weights(model)
    eos_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
                                               pad_token_id=tokenizer.pad_token_id)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    _spell_num_experts(out / "config.json")
    if fp8_block:
        quantize_checkpoint(out, fp8_block)
    return out


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(path: Path, block: int) -> None:
    """Rewrite a checkpoint in place as the Hugging Face FP8 ones are: each projection's weight in e4m3
    with its float32 `weight_scale_inv` [ceil(N / block), ceil(K / block)] beside it, and the
    `quantization_config` in config.json. Embeddings, norms, the router and the LM head stay as they are."""
    config = Fp8Config(block=(block, block))
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if n.rsplit(".", 2)[-2] in FP8_PROJECTIONS and n.endswith(".weight")]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_weight(tensors[name], config)
            if weight_map is not None:
                weight_map[name + "_scale_inv"] = file.name
        save_file(tensors, file, metadata={"format": "pt"})
    if weight_map is not None:
        raw = json.loads(index.read_text())
        index.write_text(json.dumps({**raw, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _spell_num_experts(path: Path) -> None:
    """transformers 5 writes `num_local_experts`; real Qwen3-MoE checkpoints spell it `num_experts`."""
    raw = json.loads(path.read_text())
    if "num_local_experts" in raw and raw.get("model_type") == "qwen3_moe":
        raw["num_experts"] = raw.pop("num_local_experts")
        path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200KB" to split the weights')
    parser.add_argument("--fp8", type=int, default=None, metavar="BLOCK",
                        help="write an FP8 checkpoint (Hugging Face layout) with BLOCK x BLOCK weight scales")
    args = parser.parse_args()
    print(make_tiny_model(args.out_dir, args.arch, args.seed, args.max_shard_size, fp8_block=args.fp8))


if __name__ == "__main__":
    main()
