"""Prefix cache over a paged KV pool: requests sharing a token prefix reuse the pages holding its K/V.

Works at page granularity: only whole pages are cached and matched. Every decision (split, eviction
order) is deterministic, so several processes driving identical caches with identical calls agree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol, Sequence


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache; `handle` is opaque to callers."""

    page_size: int

    def match(self, token_ids: Sequence[int]) -> tuple[object, list[int]]: ...
    def lock(self, handle: object) -> None: ...
    def unlock(self, handle: object) -> None: ...
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]: ...
    def evict(self, num_pages: int) -> list[int]: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def cached_pages(self) -> int: ...
    def reset(self) -> list[int]: ...


class _Node:
    """A radix tree edge: `key` tokens whose K/V live in `pages` (one page per page_size tokens)."""

    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "id")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, node_id: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = 0
        self.id = node_id


class RadixCache:
    """Radix tree of cached token sequences with ref-count locking and LRU eviction of leaves."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # logical time, so LRU order never depends on wall time
        self._root = _Node((), [], None, next(self._ids))
        self._num_nodes = 0
        self._cached = 0
        self._evictable = 0
        self._heap: list[tuple[int, int, _Node]] = []  # candidate leaves, validated lazily on pop

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def cached_pages(self) -> int:
        return self._cached

    def match(self, token_ids: Sequence[int]) -> tuple[_Node, list[int]]:
        """Longest cached whole-page prefix; splits a node so the handle covers exactly the match."""
        ps = self.page_size
        tokens = tuple(token_ids[: len(token_ids) // ps * ps])
        node, pos, pages = self._root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            matched = self._common_pages(child.key, tokens, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            node, pos = child, pos + len(child.key)
            pages.extend(child.pages)
        self._touch(node)
        return node, pages

    def lock(self, handle: object) -> None:
        """Pin the matched path so eviction cannot free pages a running request reads."""
        node = handle
        assert isinstance(node, _Node) and (node is self._root or node.parent is not None), "stale handle"
        while node is not self._root:
            if node.ref == 0:
                self._evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, handle: object) -> None:
        node = handle
        assert isinstance(node, _Node) and (node is self._root or node.parent is not None), "stale handle"
        while node is not self._root:
            assert node.ref > 0, "unlock without matching lock"
            node.ref -= 1
            if node.ref == 0:
                self._evictable += len(node.pages)
                self._push_if_evictable(node)
            node = node.parent

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache a page-aligned sequence; returns the caller's pages duplicating already-cached ones."""
        ps = self.page_size
        if len(token_ids) != len(pages) * ps:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(pages)} pages of {ps}")
        tokens = tuple(token_ids)
        node, i, duplicates = self._root, 0, []
        while i < len(pages):
            first = tokens[i * ps : (i + 1) * ps]
            child = node.children.get(first)
            if child is None:
                child = _Node(tokens[i * ps :], list(pages[i:]), node, next(self._ids))
                node.children[first] = child
                self._num_nodes += 1
                self._cached += len(child.pages)
                self._evictable += len(child.pages)
                node = child
                break
            matched = self._common_pages(child.key, tokens, i * ps)
            if matched < len(child.pages):
                child = self._split(child, matched)
            duplicates += [p for own, p in zip(child.pages, pages[i : i + matched]) if own != p]
            node, i = child, i + matched
        self._touch(node)
        return duplicates

    def evict(self, num_pages: int) -> list[int]:
        """Free least-recently-used unlocked leaves until num_pages pages are freed or none remain."""
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._is_evictable(node) or node.last_access != last_access:
                continue  # stale entry: node was touched, locked, extended or removed since
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self._num_nodes -= 1
            self._cached -= len(node.pages)
            self._evictable -= len(node.pages)
            freed += node.pages
            self._push_if_evictable(parent)
        return freed

    def reset(self) -> list[int]:
        """Drop every node (nothing may be locked); returns all pages for the caller to free."""
        assert self._evictable == self._cached, "reset while requests hold locked prefixes"
        pages: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            pages += node.pages
            stack += node.children.values()
        self.__init__(self.page_size)
        return pages

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Number of whole pages of `key` equal to tokens[start:]."""
        limit = min(len(key), len(tokens) - start)
        n = 0
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return n // self.page_size

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut `node` after num_pages pages; the new parent inherits ref and access so locks stay exact."""
        cut = num_pages * self.page_size
        head = _Node(node.key[:cut], node.pages[:num_pages], node.parent, next(self._ids))
        head.ref, head.last_access = node.ref, node.last_access
        node.parent.children[node.key[: self.page_size]] = head
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], head
        head.children[node.key[: self.page_size]] = node
        self._num_nodes += 1
        return head

    def _touch(self, node: _Node) -> None:
        """Stamp the path from node to the root as just used."""
        now = next(self._clock)
        leaf = node
        while node is not self._root:
            node.last_access = now
            node = node.parent
        self._push_if_evictable(leaf)

    def _is_evictable(self, node: _Node) -> bool:
        return node.parent is not None and not node.children and node.ref == 0

    def _push_if_evictable(self, node: _Node) -> None:
        if not self._is_evictable(node):
            return
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * self._num_nodes + 64:  # repeated touches leave stale entries; compact
            self._heap = [e for e in self._heap if self._is_evictable(e[2]) and e[2].last_access == e[0]]
            heapq.heapify(self._heap)


class NaiveCache:
    """No sharing: every request computes its whole prompt and frees its pages when it finishes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._root = object()

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0

    def match(self, token_ids: Sequence[int]) -> tuple[object, list[int]]:
        return self._root, []

    def lock(self, handle: object) -> None:
        pass

    def unlock(self, handle: object) -> None:
        pass

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(pages)} pages of {self.page_size}")
        return list(pages)

    def evict(self, num_pages: int) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []


def make_prefix_cache(kind: str, page_size: int) -> PrefixCache:
    """Build the prefix cache named by the engine config ("radix" or "naive")."""
    if kind == "radix":
        return RadixCache(page_size)
    if kind == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown prefix cache kind {kind!r} (expected 'radix' or 'naive')")
