"""Physical KV storage and the bookkeeping of who owns which page.

Slot = page * page_size + offset. The page table maps (request row, page index) -> page; one extra
scratch page at the end of the pool absorbs writes from padding tokens (CUDA-graph batches).
"""

from __future__ import annotations

import torch


class KVPool:
    """Per layer one K and one V buffer of shape [num_slots, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.scratch_page = num_pages
        shape = (num_layers, (num_pages + 1) * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize


class PageAllocator:
    """A LIFO free list of page ids (deterministic, so every TP rank hands out the same pages)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self.free_pages), "caller must check num_free first"
        taken = self.free_pages[len(self.free_pages) - n:]
        del self.free_pages[len(self.free_pages) - n:]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))
