"""Prefix cache tests: radix matching/splitting, duplicate pages, locking, LRU eviction, page accounting."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache import KVCacheManager
from minisgl.kvcache.prefix_cache import NaiveCache, RadixCache, make_prefix_cache

PAGE_SIZES = pytest.mark.parametrize("ps", [1, 4])


def toks(ps: int, labels: list[int]) -> list[int]:
    """Tokens filling one page per label, so tests can speak in pages whatever the page size."""
    return [label * 1000 + j for label in labels for j in range(ps)]


@PAGE_SIZES
def test_insert_then_match_full_partial_none(ps: int) -> None:
    cache = RadixCache(ps)
    assert cache.insert(toks(ps, [1, 2, 3, 4]), [10, 11, 12, 13]) == []
    assert (cache.cached_pages, cache.evictable_pages) == (4, 4)

    assert cache.match(toks(ps, [1, 2, 3, 4]))[1] == [10, 11, 12, 13]
    assert cache.match(toks(ps, [1, 2, 3, 4, 5]))[1] == [10, 11, 12, 13]
    handle, pages = cache.match(toks(ps, [9, 1, 2]))
    assert pages == []
    cache.lock(handle)  # the root handle: locking it pins nothing
    assert cache.evictable_pages == 4
    cache.unlock(handle)

    handle, pages = cache.match(toks(ps, [1, 2, 9]))  # ends inside the node: split at page 2
    assert pages == [10, 11]
    assert (cache.cached_pages, cache.evictable_pages) == (4, 4)
    cache.lock(handle)
    assert cache.evictable_pages == 2  # the handle covers exactly [10, 11]
    assert cache.evict(100) == [12, 13]
    assert cache.match(toks(ps, [1, 2, 3, 4]))[1] == [10, 11]
    cache.unlock(handle)
    assert cache.evictable_pages == cache.cached_pages == 2


@PAGE_SIZES
def test_match_truncates_to_whole_pages(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(list(range(16)), list(range(100, 100 + 16 // ps)))
    handle, pages = cache.match(list(range(10)) + [999] * 6)  # 10 tokens agree
    assert pages == list(range(100, 100 + 10 // ps))
    assert len(pages) * ps == (8 if ps == 4 else 10)
    assert cache.match(list(range(10)))[1] == pages  # a short query is truncated the same way
    cache.lock(handle)
    assert cache.evictable_pages == 16 // ps - 10 // ps
    cache.unlock(handle)
    if ps == 4:
        handle, pages = cache.match([0, 1, 2])  # less than one page
        assert pages == []
        cache.lock(handle)
        assert cache.evictable_pages == 4
        cache.unlock(handle)


@PAGE_SIZES
def test_insert_cached_prefix_under_other_pages_returns_duplicates(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2, 3]), [10, 11, 12])
    assert cache.insert(toks(ps, [1, 2, 5, 6]), [20, 21, 22, 23]) == [20, 21]
    assert (cache.cached_pages, cache.evictable_pages) == (5, 5)
    assert cache.match(toks(ps, [1, 2, 5, 6]))[1] == [10, 11, 22, 23]
    assert cache.match(toks(ps, [1, 2, 3]))[1] == [10, 11, 12]
    assert cache.insert(toks(ps, [1, 2, 3]), [10, 30, 12]) == [30]  # only the differing page
    assert cache.cached_pages == 5


@PAGE_SIZES
def test_insert_identical_pages_returns_nothing(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2]), [10, 11])
    assert cache.insert(toks(ps, [1, 2]), [10, 11]) == []
    assert cache.insert(toks(ps, [1]), [10]) == []
    assert cache.cached_pages == 2
    assert cache.insert(toks(ps, [1, 2, 3]), [10, 11, 12]) == []  # extends the cached sequence
    assert (cache.cached_pages, cache.evictable_pages) == (3, 3)
    assert cache.match(toks(ps, [1, 2, 3]))[1] == [10, 11, 12]


@PAGE_SIZES
def test_insert_rejects_misaligned_input(ps: int) -> None:
    with pytest.raises(ValueError):
        RadixCache(ps).insert(toks(ps, [1, 2]) + [7], [10, 11])
    with pytest.raises(ValueError):
        RadixCache(ps).insert(toks(ps, [1, 2]), [10])


@PAGE_SIZES
def test_split_keeps_lock_counts_consistent(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2, 3, 4]), [10, 11, 12, 13])
    deep, pages = cache.match(toks(ps, [1, 2, 3, 4]))
    cache.lock(deep)
    cache.lock(deep)
    assert cache.evictable_pages == 0

    assert cache.insert(toks(ps, [1, 2, 7, 8]), [10, 11, 20, 21]) == []  # splits the locked path at page 2
    assert (cache.cached_pages, cache.evictable_pages) == (6, 2)
    mid, pages = cache.match(toks(ps, [1, 2]))
    assert pages == [10, 11]
    cache.lock(mid)
    cache.unlock(mid)
    assert cache.evict(100) == [20, 21]
    assert (cache.cached_pages, cache.evictable_pages) == (4, 0)

    cache.unlock(deep)
    assert cache.evict(100) == []  # still locked once
    cache.unlock(deep)
    assert cache.evictable_pages == 4
    assert sorted(cache.evict(100)) == [10, 11, 12, 13]
    assert (cache.cached_pages, cache.evictable_pages) == (0, 0)


@PAGE_SIZES
def test_evict_order_is_lru(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2]), [10, 11])
    cache.insert(toks(ps, [3, 4]), [20, 21])
    cache.match(toks(ps, [1, 2]))  # touch the older branch: the other one becomes least recent
    assert cache.evict(1) == [20, 21]  # whole nodes go, even if that frees more than asked
    assert (cache.cached_pages, cache.evictable_pages) == (2, 2)
    assert cache.evict(1) == [10, 11]


@PAGE_SIZES
def test_parent_becomes_evictable_after_its_children(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2, 3]), [10, 11, 12])
    cache.insert(toks(ps, [1, 2, 4]), [10, 11, 13])
    cache.insert(toks(ps, [5]), [50])
    cache.match(toks(ps, [1, 2, 3]))
    cache.match(toks(ps, [5]))  # now [1, 2, 4] is the least recent leaf, then [1, 2, 3], then [5]
    assert cache.evict(1) == [13]
    assert cache.evict(1) == [12]
    assert cache.evict(1) == [10, 11]  # the parent, now a leaf, is older than [5]
    assert cache.evict(1) == [50]
    assert cache.evict(1) == []
    assert (cache.cached_pages, cache.evictable_pages) == (0, 0)


@PAGE_SIZES
def test_evict_never_returns_locked_pages(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2]), [10, 11])
    cache.insert(toks(ps, [3]), [20])
    handle, _ = cache.match(toks(ps, [1, 2]))
    cache.lock(handle)
    assert (cache.cached_pages, cache.evictable_pages) == (3, 1)
    assert cache.evict(100) == [20]
    assert cache.evict(100) == []
    assert (cache.cached_pages, cache.evictable_pages) == (2, 0)
    cache.unlock(handle)
    assert cache.evictable_pages == 2
    assert cache.evict(100) == [10, 11]
    with pytest.raises(AssertionError):
        cache.unlock(handle)  # evicted handles are stale


@PAGE_SIZES
def test_unlock_below_zero_asserts(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1]), [10])
    handle, _ = cache.match(toks(ps, [1]))
    with pytest.raises(AssertionError):
        cache.unlock(handle)


@PAGE_SIZES
def test_reset(ps: int) -> None:
    cache = RadixCache(ps)
    cache.insert(toks(ps, [1, 2, 3]), [10, 11, 12])
    cache.insert(toks(ps, [1, 4]), [10, 14])
    handle, _ = cache.match(toks(ps, [1, 4]))
    cache.lock(handle)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(handle)
    assert sorted(cache.reset()) == [10, 11, 12, 14]
    assert (cache.cached_pages, cache.evictable_pages) == (0, 0)
    assert cache.match(toks(ps, [1, 2, 3]))[1] == []
    assert cache.insert(toks(ps, [1]), [7]) == []


@PAGE_SIZES
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_against_page_allocator(ps: int, seed: int) -> None:
    """Requests match, lock, allocate, insert, finish; evictions interleave. Every page is owned by
    exactly one of {allocator, caller, cache} at all times, so a double free or a leak shows up."""
    rng = random.Random(seed)
    cache = RadixCache(ps)
    num_pages = 48
    free = list(range(num_pages))
    owner = {p: "free" for p in free}
    running: list[tuple[object, list[int]]] = []  # locked (handle, matched pages)

    def give_back(pages: list[int], expected_owner: str) -> None:
        for p in pages:
            assert owner[p] == expected_owner, f"page {p} freed while {owner[p]}"
            owner[p] = "free"
            free.append(p)

    def locked_pages() -> set[int]:
        return {p for _, pages in running for p in pages}

    def evict(n: int) -> None:
        freed = cache.evict(n)
        assert not set(freed) & locked_pages()
        give_back(freed, "cache")

    def alloc(n: int) -> list[int] | None:
        if len(free) < n:
            evict(n - len(free))
        if len(free) < n:
            return None
        pages = [free.pop() for _ in range(n)]
        for p in pages:
            owner[p] = "caller"
        return pages

    def random_seq() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randint(1, 8) * ps)]

    for _ in range(1500):
        op = rng.random()
        if op < 0.5:  # a new request
            seq = random_seq()
            extra = [rng.randrange(3) for _ in range(rng.randrange(ps))]  # a partial page is never matched
            handle, hit = cache.match(seq + extra)
            assert all(owner[p] == "cache" for p in hit)
            cache.lock(handle)
            reuse = rng.random() < 0.7
            fresh = alloc(len(seq) // ps - (len(hit) if reuse else 0))
            if fresh is None:
                cache.unlock(handle)
                continue
            dup = cache.insert(seq, (hit if reuse else []) + fresh)
            assert len(set(dup)) == len(dup) and set(dup) <= set(fresh)
            if reuse:
                assert dup == []
            give_back(dup, "caller")
            for p in fresh:
                if owner[p] == "caller":
                    owner[p] = "cache"
            full, pages = cache.match(seq)
            assert len(pages) * ps == len(seq) and pages[: len(hit)] == hit
            cache.lock(full)
            cache.unlock(handle)
            running.append((full, pages))
        elif op < 0.75 and running:  # a request finishes
            handle, _ = running.pop(rng.randrange(len(running)))
            cache.unlock(handle)
        elif op < 0.9:
            evict(rng.randint(1, 10))
        else:
            assert all(owner[p] == "cache" for p in cache.match(random_seq())[1])
        held = sum(1 for o in owner.values() if o == "cache")
        assert cache.cached_pages == held
        assert cache.evictable_pages == held - len(locked_pages())
        assert "caller" not in owner.values()

    for handle, _ in running:
        cache.unlock(handle)
    running.clear()
    assert cache.evictable_pages == cache.cached_pages
    evict(10**9)
    assert (cache.cached_pages, cache.evictable_pages) == (0, 0)
    assert sorted(free) == list(range(num_pages))


@PAGE_SIZES
def test_naive_cache_shares_nothing(ps: int) -> None:
    cache = NaiveCache(ps)
    assert cache.insert(toks(ps, [1, 2]), [10, 11]) == [10, 11]
    handle, pages = cache.match(toks(ps, [1, 2]))
    assert pages == []
    cache.lock(handle)
    cache.unlock(handle)
    assert cache.evict(100) == []
    assert (cache.cached_pages, cache.evictable_pages) == (0, 0)
    assert cache.reset() == []


def test_make_prefix_cache() -> None:
    assert isinstance(make_prefix_cache("radix", 4), RadixCache)
    assert isinstance(make_prefix_cache("naive", 4), NaiveCache)
    with pytest.raises(ValueError, match="bogus"):
        make_prefix_cache("bogus", 4)


def test_cache_salt_keeps_tenants_apart() -> None:
    """vLLM's cache_salt: a request reuses pages cached by requests of its own salt only (no salt is a salt
    of its own), through the manager that keys the cache."""
    manager = KVCacheManager(64, 2, RadixCache(2), torch.zeros(4, 32, dtype=torch.int32), 4)
    rids = iter(range(100))

    def cached(salt: str | None) -> int:
        req = Req(next(rids), list(range(10)), SamplingParams(), 0, cache_salt=salt)
        manager.admit(req)
        assert manager.reserve(req, req.seq_len - req.kv_len)
        req.kv_len = req.seq_len  # as if the prefill ran
        manager.release(req)
        return req.cached_tokens

    assert [cached("a"), cached("a"), cached("b"), cached(None), cached("b"), cached(None), cached("a")] == [
        0, 8, 0, 0, 8, 8, 8]


@PAGE_SIZES
def test_flush_writes_each_rows_pages_and_only_the_last_owners(ps: int) -> None:
    """One flush per step sends every admission's and allocation's page-table entries: each running request's row
    then holds exactly its pages (a cached prefix, then chunks reserved over several steps). A row freed and
    handed to another request before the flush holds the new owner's pages, not the old ones. Runs of one page
    and of many share a flush."""
    table = torch.full((4, 64), -1, dtype=torch.int32)
    manager = KVCacheManager(200, ps, RadixCache(ps), table, 4)
    rids = iter(range(100))

    def admitted(tokens: list[int], first_chunk: int) -> Req:
        req = Req(next(rids), tokens, SamplingParams(), 0)
        manager.admit(req)
        assert manager.reserve(req, first_chunk)
        return req

    done = admitted(list(range(6 * ps)), 6 * ps)
    manager.flush()
    done.kv_len = done.seq_len
    manager.release(done)  # its pages go to the prefix cache
    a = admitted(list(range(6 * ps)) + [999] * (3 * ps), 2 * ps)  # a 6-page cached prefix, then 2 pages
    gone = admitted([7] * (5 * ps), 5 * ps)
    row = gone.row
    manager.release(gone)  # freed before the flush: its row goes back, its entries with it
    b = admitted([8] * (2 * ps), 2 * ps)
    assert b.row == row
    c = admitted([9] * ps, ps)  # a one-page run among longer ones in the same flush
    manager.flush()
    a.kv_len += 2 * ps
    assert manager.reserve(a, ps)  # the next step's allocation: one-page runs only
    manager.flush()
    for req in (a, b, c):
        assert table[req.row, :len(req.pages)].tolist() == req.pages
    assert table[b.row, len(b.pages):5].tolist() == [-1] * (5 - len(b.pages))  # gone's pages never written
    assert len(a.pages) == 9 and a.cached_tokens == 6 * ps
