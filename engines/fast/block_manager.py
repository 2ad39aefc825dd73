"""The pool of KV pages: allocation, reference counts, release.

Ownership is explicit: a page is free exactly when its reference count is zero. Today every
page has one owner (the sequence that allocated it); prefix caching will add shared pages
(refcount > 1) keyed by a chained hash of full blocks, which is why `hashes` exists.
Page 0 is the null page and never handed out.
"""

from __future__ import annotations

from collections import deque

from wicore.engines.fast.kv_cache import NULL_PAGE


class OutOfPages(Exception):
    """Not enough free pages; the caller waits for sequences to finish (nothing is preempted)."""


class BlockManager:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.ref_counts[NULL_PAGE] = 1  # pinned forever
        self.hashes: list[int | None] = [None] * num_pages  # prefix-cache key of a full block (later)
        self.free_pages: deque[int] = deque(range(NULL_PAGE + 1, num_pages))  # the null page is 0

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """`count` pages, each with one reference; all or none."""
        if not self.can_allocate(count):
            raise OutOfPages(f"asked for {count} KV pages, {self.num_free} free")
        pages = [self.free_pages.popleft() for _ in range(count)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages that reach zero become free."""
        for page in pages:
            if page == NULL_PAGE or self.ref_counts[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.hashes[page] = None
                self.free_pages.append(page)
