"""The model hyper-parameters we use, read straight from a checkpoint's config.json.

Reading the JSON ourselves (rather than through transformers' config classes) keeps both spellings of
rope settings working: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minisgl.quantization import Fp8Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # FP8 weights: a checkpoint's block-scaled `quantization_config`, or per-channel from `--quantization fp8`.
    quantization: Fp8Config | None = None

    def fp8_for(self, module: str) -> Fp8Config | None:
        """The FP8 settings of the linear layer (or experts) named `module`, None where it stays unquantized."""
        q = self.quantization
        return q if q is not None and q.covers(module) else None

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = raw["num_attention_heads"]
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        eos = raw.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 0),
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and no o_proj bias; the others follow `attention_bias`.
            qkv_bias=raw.get("attention_bias", False) or archs[0] == "Qwen2ForCausalLM",
            o_proj_bias=raw.get("attention_bias", False) and archs[0] != "Qwen2ForCausalLM",
            qk_norm=archs[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            dtype=DTYPES.get(str(dtype_name).replace("torch.", ""), torch.bfloat16),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            num_experts=raw.get("num_experts") or raw.get("num_local_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            norm_topk_prob=raw.get("norm_topk_prob", True),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=list(raw.get("mlp_only_layers") or []),
            quantization=Fp8Config.from_hf(raw.get("quantization_config")),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config = cls.from_dict(json.loads((path / "config.json").read_text()))
        gen = path / "generation_config.json"
        if gen.exists():  # generation_config's EOS ids are the ones generate() stops on
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                extra = [eos] if isinstance(eos, int) else list(eos)
                config.eos_token_ids = sorted(set(config.eos_token_ids) | set(extra))
        return config
