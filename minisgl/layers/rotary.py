"""Rotary position embedding (rotate-half layout), with Llama-3 frequency scaling; it also writes each
layer's new K/V into the KV pool (on a GPU in the same kernel: see minisgl/kernels/rotary.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl.kernels import TRITON_AVAILABLE, use_triton
from minisgl.kvcache.pool import KVPool
from minisgl.layers.norm import RMSNorm

if TRITON_AVAILABLE:
    from minisgl.kernels.rotary import qk_norm_rope_store

QK = tuple[torch.Tensor, torch.Tensor]


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context rule: keep high frequencies, divide low ones by `factor`, and blend
    linearly (in wavelength) between the two bands."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool,
                layer: int, slots: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q: [T, heads, head_dim], k and v: [T, kv_heads, head_dim], positions and slots: [T] -> the rotated
        q; the rotated k and v go to `pool`'s `layer` at `slots`. With q_norm and k_norm (Qwen3), each head
        is RMS-normalised before the rotation. On a GPU one Triton kernel does all of it for every head of a
        token; elsewhere `forward_torch` and `KVPool.store`, which are also the kernel's reference."""
        if not use_triton(q):
            q, k = self.forward_torch(positions, q, k, q_norm, k_norm)
            pool.store(layer, slots, k, v)
            return q
        caches = pool.k[layer], pool.v[layer]
        if q_norm is None:
            return qk_norm_rope_store(q, k, v, positions, self.cos, self.sin, *caches, slots)
        assert q_norm.eps == k_norm.eps, "the fused kernel takes one eps for both norms"
        return qk_norm_rope_store(q, k, v, positions, self.cos, self.sin, *caches, slots, q_norm.weight,
                                  k_norm.weight, q_norm.eps)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> QK:
        if q_norm is not None:
            q, k = q_norm.norm(q), k_norm.norm(k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)
