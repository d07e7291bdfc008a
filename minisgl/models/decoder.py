"""One decoder-only transformer covering Llama, Qwen2, Qwen3 and Qwen3-MoE.

The four differ only in switches read from config.json: q/k/v (and o) biases, per-head q/k RMSNorm,
tied embeddings, Llama-3 rope scaling, and which layers use a sparse MoE instead of a dense MLP.
Parameter names mirror the Hugging Face checkpoints, with q/k/v and gate/up merged.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from minisgl.attention.base import StepAttention
from minisgl.distributed import TPGroup
from minisgl.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minisgl.layers.moe import SparseMoE
from minisgl.models.config import ModelConfig
from minisgl.quantization import Fp8Config


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        d, prefix = config.head_dim, f"model.layers.{layer_id}.self_attn."
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_heads, config.num_kv_heads,
                                          config.qkv_bias, tp, config.fp8_for(prefix + "q_proj"))
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, config.o_proj_bias, tp, "o_proj",
                                        config.fp8_for(prefix + "o_proj"))
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: StepAttention):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(t, self.heads, d), k.view(t, self.kv_heads, d), v.view(t, self.kv_heads, d)
        # Qwen3's per-head q/k norm (if any), then rope; k and v go into the KV pool in the same kernel.
        q = rope(positions, q, k, v, attn.pool, self.layer_id, attn.slots, self.q_norm, self.k_norm)
        return self.o_proj(attn.attend(self.layer_id, q))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, quant: Fp8Config | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], False, tp, "gate_up_proj",
                                                 quant)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, "down_proj", quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), silu_mul=True)  # in the decode GEMV: one launch fewer


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(config, layer_id, tp)
        mlp = f"model.layers.{layer_id}.mlp."
        if config.is_moe_layer(layer_id):
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob, tp,
                                 config.fp8_for(mlp + "experts"))
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, config.fp8_for(mlp + "gate_proj"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, attn):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                    config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, attn)
        x, _ = self.norm(x, residual)
        return x


# checkpoint name pattern -> (parameter name replacement, shard id builder)
# (FP8 checkpoints store each weight's scales next to it as `weight_scale_inv`.)
_MERGED = [
    (re.compile(r"\.experts\.(\d+)\.(gate|up)_proj\.weight(_scale_inv)?$"),
     lambda m: (f".w13{m[3] or ''}", (int(m[1]), 0 if m[2] == "gate" else 1))),
    (re.compile(r"\.experts\.(\d+)\.down_proj\.weight(_scale_inv)?$"), lambda m: (f".w2{m[2] or ''}", (int(m[1]), 0))),
    (re.compile(r"\.([qkv])_proj\.(weight|bias|weight_scale_inv)$"),
     lambda m: (f".qkv_proj.{m[2]}", "qkv".index(m[1]))),
    (re.compile(r"\.(gate|up)_proj\.(weight|weight_scale_inv)$"),
     lambda m: (f".gate_up_proj.{m[2]}", 0 if m[1] == "gate" else 1)),
]


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def param_for(self, checkpoint_name: str) -> tuple[str, object] | None:
        """Map a checkpoint tensor name to (parameter name, shard id or None); None means 'skip it'."""
        if "rotary_emb." in checkpoint_name:
            return None
        if checkpoint_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for pattern, target in _MERGED:
            match = pattern.search(checkpoint_name)
            if match:
                suffix, shard = target(match)
                return checkpoint_name[: match.start()] + suffix, shard
        return checkpoint_name, None
