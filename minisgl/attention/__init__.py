"""Attention backends behind one interface: prepare(batch) once, then forward per layer."""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend, ForwardInput
from minisgl.attention.torch_backend import TorchBackend
from minisgl.attention.triton_backend import TritonBackend
from minisgl.kvcache.pool import KVPool

BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}


def make_backend(name: str, pool: KVPool, page_table) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name](pool, page_table)


__all__ = ["AttentionBackend", "BACKENDS", "ForwardInput", "make_backend"]
