"""Attention backends behind one interface: prepare(batch) once, then attend per layer."""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend, ForwardInput, StepAttention
from minisgl.attention.torch_backend import TorchBackend
from minisgl.kvcache.pool import KVPool

BACKENDS = ("torch", "triton")


def make_backend(name: str, pool: KVPool, page_table) -> AttentionBackend:
    if name == "torch":
        return TorchBackend(pool, page_table)
    if name == "triton":  # imported on demand: Triton comes with CUDA builds of torch, not with CPU ones
        from minisgl.attention.triton_backend import TritonBackend

        return TritonBackend(pool, page_table)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "BACKENDS", "ForwardInput", "StepAttention", "make_backend"]
