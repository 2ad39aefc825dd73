"""The pool of KV pages: allocation, reference counts, release, and the prefix cache's pages.

Ownership is explicit: a page is free exactly when its reference count is zero. Its holders are
the sequences whose tables point at it, plus the prefix cache for a page of a cached block
(`gpu_tier.PrefixCache`). A cached block whose users have all finished keeps only the cache's
reference: it is evictable, and `allocate` evicts such blocks (by the cache's policy) when the
free list is short. Evicted blocks queue in `evicted` until the engine has copied them to a lower
tier: their pages are handed out at once, and stream order puts that copy before any write.
Page 0 is the null page and never handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.gpu_tier import CachedBlock, PrefixCache
from wicore.engines.kvcache.kv_layout import NULL_PAGE


class OutOfPages(Exception):
    """Not enough free pages; the caller waits for sequences to finish (nothing is preempted)."""


class BlockManager:
    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.cache = cache  # None: prefix caching off
        self.ref_counts = [0] * num_pages
        self.ref_counts[NULL_PAGE] = 1  # pinned forever
        self.free_pages: deque[int] = deque(range(NULL_PAGE + 1, num_pages))  # the null page is 0
        self.evicted: list[CachedBlock] = []  # evicted since `take_evicted`, pages already reused

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_cached(self) -> int:
        """Pages only the prefix cache holds (evictable)."""
        return self.cache.evictable_pages if self.cache is not None else 0

    @property
    def num_used(self) -> int:
        """Pages held by sequences."""
        return self.num_pages - 1 - self.num_free - self.num_cached

    def can_allocate(self, count: int, reusing: Sequence[CachedBlock] = ()) -> bool:
        """Whether `count` new pages fit once the cached `reusing` blocks are in use."""
        evictable = self.cache.evictable_pages_without(reusing) if self.cache is not None else 0
        return count <= self.num_free + evictable

    def allocate(self, count: int) -> list[int]:
        """`count` pages, each with one reference; all or none. Evicts cached blocks as needed."""
        if not self.can_allocate(count):
            raise OutOfPages(f"asked for {count} KV pages, {self.num_free} free, {self.num_cached} cached")
        while self.num_free < count:
            self._evict_one()
        pages = [self.free_pages.popleft() for _ in range(count)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; pages that reach zero become free."""
        for page in pages:
            if page == NULL_PAGE or self.ref_counts[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)

    # -- the prefix cache's side ------------------------------------------------------------

    def acquire(self, blocks: Sequence[CachedBlock]) -> None:
        """A sequence takes cached blocks into its table (a reference on each page, a use of
        each block: none of them can be evicted until `release_blocks`)."""
        for block in blocks:
            self.cache.acquire(block)
            self._share(block.pages)

    def register(self, key: BlockHash, pages: tuple[int, ...], cost: float) -> CachedBlock | None:
        """Cache a block a sequence is about to compute or restore into its own `pages`; None
        when the key is cached already (the sequence's copy then stays private)."""
        if self.cache is None or key in self.cache:
            return None
        self._share(pages)
        return self.cache.insert(key, pages, cost)

    def release_blocks(self, blocks: Sequence[CachedBlock]) -> None:
        """A finishing sequence's uses (its page references go with `release`)."""
        for block in blocks:
            self.cache.release(block)

    def forget(self, blocks: Sequence[CachedBlock]) -> None:
        """Blocks registered for a sequence that stopped before writing them, with no other user:
        they leave the cache (their pages hold nothing), and the cache's page references go."""
        for block in blocks:
            self.cache.discard(block)
            self.release(block.pages)

    def take_evicted(self) -> list[CachedBlock]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def drop_cache(self) -> None:
        """Forget every cached block (after a device failure: their contents are suspect)."""
        self.evicted.clear()
        while self.cache is not None and self.cache.evictable_pages:
            self._evict_one()
        self.evicted.clear()

    def _evict_one(self) -> None:
        block = self.cache.evict()
        if block is None:
            raise OutOfPages("no evictable cached block")
        self.release(block.pages)
        if any(self.ref_counts[p] for p in block.pages):
            raise RuntimeError(f"evicted block {block.key.hex()[:16]} still has page references")
        self.evicted.append(block)

    def _share(self, pages: Sequence[int]) -> None:
        for page in pages:
            if page == NULL_PAGE or self.ref_counts[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self.ref_counts[page] += 1
