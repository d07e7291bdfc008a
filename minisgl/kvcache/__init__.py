"""Paged KV cache: the pool, page allocation, prefix sharing and per-request bookkeeping."""

from minisgl.kvcache.manager import KVCacheManager
from minisgl.kvcache.pool import KVPool, PageAllocator
from minisgl.kvcache.prefix_cache import NaiveCache, PrefixCache, RadixCache, make_prefix_cache

__all__ = ["KVCacheManager", "KVPool", "NaiveCache", "PageAllocator", "PrefixCache", "RadixCache",
           "make_prefix_cache"]
