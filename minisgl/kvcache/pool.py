"""Physical KV storage and the bookkeeping of who owns which page.

Slot = page * page_size + offset. The page table maps (request row, page index) -> page; one extra
scratch page at the end of the pool absorbs writes from padding tokens (CUDA-graph batches).

The pool may store K/V in a narrower type than the model computes in (`--kv-cache-dtype fp8`): values are
cast on store and upcast on read. FP8 here is float8_e4m3fn with a scale of 1.0 (no calibrated scales, as
vLLM without a checkpoint's k/v scales): a value rounds to the nearest e4m3 number and saturates at +-448.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # besides "auto": the model's


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype NAME`."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: rounded to nearest (ties to even), fp8 saturating at +-448 rather than overflowing."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


class KVPool:
    """Per layer one K and one V buffer of shape [num_slots, kv_heads, head_dim], of `cache_dtype`;
    `dtype` is the model's, in which K/V arrive and are read back."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype | None = None):
        self.page_size = page_size
        self.scratch_page = num_pages
        self.dtype = dtype
        shape = (num_layers, (num_pages + 1) * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=cache_dtype or dtype, device=device)
        self.v = torch.zeros(shape, dtype=cache_dtype or dtype, device=device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copied as bytes: torch's index_copy_ has no fp8 kernels (and a byte copy is the same for any type)."""
        for cache, new in ((self.k, k), (self.v, v)):
            cache[layer].view(torch.uint8).index_copy_(0, slots, to_cache_dtype(new, cache.dtype).view(torch.uint8))

    def load(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape) upcast to `dtype`; gathered as bytes, as `store` writes them."""
        return tuple(cache[layer].view(torch.uint8)[slots].view(cache.dtype).to(dtype) for cache in (self.k, self.v))

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
