"""Request-level KV bookkeeping: page-table rows, page allocation, prefix sharing and release.

Invariant: every page is in exactly one place: the free list, a running request that owns it
alone, or the prefix cache (locked by running requests that share it, or evictable). So
free + evictable == total once no request is running.
"""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.kvcache.pool import PageAllocator
from minisgl.kvcache.prefix_cache import PrefixCache


def cache_key(req: Req, tokens: list[int]) -> list:
    """The prefix cache's key for req's tokens. With a cache_salt the first element is (salt, first token):
    it equals no token and no other salt's, so salted requests share pages only with the same salt, while
    pages stay aligned with the tokens whose K/V they hold."""
    if req.cache_salt is None or not tokens:
        return tokens
    return [(req.cache_salt, tokens[0]), *tokens[1:]]


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, cache: PrefixCache, page_table: torch.Tensor, num_rows: int):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = cache
        self.page_table = page_table  # [rows, max_pages_per_seq] int32, on the model's device
        self.free_rows = list(range(num_rows - 1, -1, -1))  # rows past num_rows are not for requests
        # Page-table entries written since the last flush, per row as (first index, pages) runs: one copy per step
        # instead of one per request. A row's runs go when it is freed, so a row handed out again within a step
        # gets only its new owner's pages (no index is written twice in one copy, whose order would be undefined).
        self._pending: dict[int, list[tuple[int, list[int]]]] = {}

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can get: free ones plus what eviction could reclaim."""
        return self.allocator.num_free + self.cache.evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admit(self, req: Req, match: bool = True) -> None:
        """Give `req` a table row and the longest cached prefix of its tokens (locked while it runs; none
        without `match`: a request that needs logits at every prompt position computes them all).

        At least one token is always left to compute, since its logits are what we sample from."""
        handle, pages = self.cache.match(cache_key(req, req.all_ids[: req.seq_len - 1]) if match else [])
        self.cache.lock(handle)
        req.row = self.free_rows.pop()
        req.cache_handle, req.pages = handle, list(pages)
        req.kv_len = len(pages) * self.page_size
        if not req.output_ids:  # a retracted request re-finding its own pages is not a cache hit
            req.cached_tokens = min(req.kv_len, len(req.prompt_ids))
        self._write_table(req, 0)

    def reserve(self, req: Req, num_tokens: int) -> bool:
        """Make sure pages back req's next `num_tokens` tokens, evicting cached pages if need be.
        All or nothing: on False nothing changed."""
        need = self.pages_for(req.kv_len + num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if need > self.available_pages:
            return False
        if need > self.allocator.num_free:
            self.allocator.free(self.cache.evict(need - self.allocator.num_free))
        start = len(req.pages)
        req.pages += self.allocator.alloc(need)
        self._write_table(req, start)
        return True

    def release(self, req: Req) -> None:
        """Return everything `req` holds: full pages of computed tokens go to the prefix cache (where
        a later request, or this one after retraction, can reuse them), the rest to the free list.
        Only tokens the host knows are cached: with overlap scheduling the last one may still be in
        flight (its K/V are written by a step still queued on the device, which runs before any later
        step that could read these pages)."""
        full = min(req.kv_len, req.seq_len) // self.page_size
        tokens = req.all_ids[: full * self.page_size]
        self.allocator.free(self.cache.insert(cache_key(req, tokens), req.pages[:full]))
        self.allocator.free(req.pages[full:])
        self.cache.unlock(req.cache_handle)
        self._pending.pop(req.row, None)
        self.free_rows.append(req.row)
        req.row, req.pages, req.kv_len, req.cache_handle = -1, [], 0, None

    def _write_table(self, req: Req, start: int) -> None:
        if start < len(req.pages):
            self._pending.setdefault(req.row, []).append((start, req.pages[start:]))

    def flush(self) -> None:
        """Send the page-table entries of this step's admissions and allocations to the device, in one
        host->device copy; the scheduler calls it before it launches the step. The host sends each run as (row,
        first index, length) and its pages, and the device expands the runs into entries: at one token per page a
        busy step writes thousands of entries, and laying them out as flat lists in Python took ~0.9 ms of host time
        for 7,200 (64 decodes beside 8 chunks of 900 tokens, this machine's CPU) against ~0.3 ms for the runs and
        pages (`torch.repeat_interleave` with its output size given waits for nothing). A pure-decode step's runs are
        one page each, and are the entries as sent. No CPU torch ops beyond the one tensor: on an H200 server they
        cost a decode step milliseconds of host time, sporadically."""
        if not self._pending:
            return
        heads, pages = [], []
        for row, runs in self._pending.items():
            for start, run in runs:
                heads += (row, start, len(run))
                pages += run
        self._pending.clear()
        device = self.page_table.device
        sent = torch.tensor(heads + pages, dtype=torch.int64).to(device, non_blocking=True)
        runs, pages_d = sent[:len(heads)].view(-1, 3), sent[len(heads):]
        rows, indices, lens = runs.unbind(1)
        if len(pages) > len(lens):  # some run is longer than a page: expand the runs into entries
            total = len(pages)
            firsts = torch.cumsum(lens, 0) - lens  # each run's first entry among the pages
            rows = torch.repeat_interleave(rows, lens, output_size=total)
            indices = torch.arange(total, device=device) + torch.repeat_interleave(indices - firsts, lens,
                                                                                   output_size=total)
        self.page_table[rows, indices] = pages_d.to(self.page_table.dtype)
