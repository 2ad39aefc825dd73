"""Eviction policies behind one interface, shared by every cache tier.

A policy only orders keys; the tier owns the data. The tier calls `insert` when it stores a key,
`touch` on every hit, `remove` when the key leaves for another reason, and `evict()` (or
`victim()` then `remove`) when it needs room. `pin`/`unpin` are counted: a key with pins is in
use (e.g. a KV block a running sequence reads) and is never a victim; it leaves the eviction
order while pinned and re-enters it on its last unpin, as most recently used.

Cost per operation: O(1) for LRU; amortised O(log n) for A2CR.
"""

from __future__ import annotations

import abc
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(abc.ABC, Generic[K]):
    """Orders the keys of one tier for eviction. Operations on unknown keys raise KeyError."""

    def __init__(self) -> None:
        self._pins: dict[K, int] = {}  # key -> pin count (> 0)

    @abc.abstractmethod
    def insert(self, key: K, cost: float = 1.0) -> None:
        """A new key; `cost` is what recomputing it would take (any unit, the same per tier)."""

    @abc.abstractmethod
    def touch(self, key: K) -> None:
        """A hit on `key`."""

    @abc.abstractmethod
    def victim(self) -> K | None:
        """The unpinned key to evict next (left in place), or None when there is none."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def _enter_order(self, key: K) -> None:
        """Put an unpinned key into the eviction order (after insert or the last unpin)."""

    @abc.abstractmethod
    def _leave_order(self, key: K) -> None:
        """Take a key out of the eviction order (first pin, or removal)."""

    @abc.abstractmethod
    def _forget(self, key: K) -> None:
        """Drop what the policy keeps about `key` beyond the order."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def remove(self, key: K) -> None:
        """Forget `key`, pinned or not."""
        if key not in self:
            raise KeyError(key)
        if self._pins.pop(key, None) is None:
            self._leave_order(key)
        self._forget(key)

    def evict(self) -> K | None:
        """Remove and return the victim."""
        key = self.victim()
        if key is not None:
            self.remove(key)
        return key

    def pin(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        if key not in self._pins:
            self._leave_order(key)
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: K) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise KeyError(f"{key!r} is not pinned")
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        self._enter_order(key)

    def is_pinned(self, key: K) -> bool:
        return key in self._pins

    @property
    def num_pinned(self) -> int:
        return len(self._pins)


class LRU(EvictionPolicy[K]):
    """Least recently used first."""

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[K, None] = OrderedDict()  # unpinned keys, oldest first

    def insert(self, key: K, cost: float = 1.0) -> None:
        if key in self:
            raise KeyError(f"{key!r} is already in the policy")
        self._enter_order(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        elif key not in self._pins:
            raise KeyError(key)
        # a pinned key takes its place at the back on its last unpin

    def victim(self) -> K | None:
        return next(iter(self._order), None)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pins

    def __len__(self) -> int:
        return len(self._order) + len(self._pins)

    def _enter_order(self, key: K) -> None:
        self._order[key] = None

    def _leave_order(self, key: K) -> None:
        del self._order[key]

    def _forget(self, key: K) -> None:
        pass  # LRU keeps nothing beyond the order


@dataclass
class _Entry:
    hits: int  # accesses, counting the insert
    cost: float
    last: float  # A2CR: clock value at the last access; GreedyDual: H value
    version: int  # the heap record with this version is the live one; -1: none is


class _HeapPolicy(EvictionPolicy[K]):
    """Evicts the lowest `_priority(entry)`, which may only change when the entry is accessed:
    a min-heap with lazy invalidation (stale records skipped, dropped when they outnumber the
    live ones) gives amortised O(log n) per operation."""

    def __init__(self) -> None:
        super().__init__()
        self._entries: dict[K, _Entry] = {}
        self._heap: list[tuple[float, int, K]] = []  # (priority, version, key); versions are unique
        self._versions = itertools.count()

    @abc.abstractmethod
    def _priority(self, entry: _Entry) -> float: ...

    @abc.abstractmethod
    def _on_access(self, entry: _Entry) -> None:
        """Update `entry.last` for an insert or a hit."""

    def insert(self, key: K, cost: float = 1.0) -> None:
        if key in self._entries:
            raise KeyError(f"{key!r} is already in the policy")
        if not cost > 0:
            raise ValueError(f"cost must be > 0, got {cost}")
        entry = _Entry(hits=1, cost=cost, last=0.0, version=-1)
        self._on_access(entry)
        self._entries[key] = entry
        self._enter_order(key)

    def touch(self, key: K) -> None:
        entry = self._entries[key]
        entry.hits += 1
        self._on_access(entry)
        if key not in self._pins:
            self._enter_order(key)  # a new record; the old one goes stale

    def victim(self) -> K | None:
        while self._heap:
            _, version, key = self._heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry.version == version:
                return key
            heapq.heappop(self._heap)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _enter_order(self, key: K) -> None:
        entry = self._entries[key]
        entry.version = next(self._versions)
        heapq.heappush(self._heap, (self._priority(entry), entry.version, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _leave_order(self, key: K) -> None:
        self._entries[key].version = -1  # its record goes stale

    def _forget(self, key: K) -> None:
        del self._entries[key]

    def _compact(self) -> None:
        self._heap = [r for r in self._heap if (e := self._entries.get(r[2])) is not None and e.version == r[1]]
        heapq.heapify(self._heap)


class LogicalClock:
    """Advances by one per access: A2CR's default time unit."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class A2CR(_HeapPolicy[K]):
    """Age-decayed, access-counted, cost-aware replacement: evict the lowest

        score = hits * exp(-decay * age) * cost,   age = now - last access.

    Time comes from `clock()`, called once per `insert`/`touch`. The default `LogicalClock`
    advances by one per access to this tier, so `decay` is per access: decay = ln 2 / h halves a
    score after h further accesses (`A2CR.with_half_life(h)`). Pass `clock=time.monotonic` to make
    `decay` per second instead.

    All scores share the factor exp(-decay * now), so their order is the order of the fixed
    priority ln(hits * cost) + decay * last, which changes only when the entry is accessed.
    """

    def __init__(self, decay: float = 1e-3, clock: Callable[[], float] | None = None) -> None:
        super().__init__()
        if decay < 0:
            raise ValueError(f"decay must be >= 0, got {decay}")
        self.decay = decay
        self._clock = clock or LogicalClock()
        self._now = 0.0

    @classmethod
    def with_half_life(cls, accesses: float) -> A2CR:
        return cls(decay=math.log(2) / accesses)

    def score(self, key: K) -> float:
        """The score defined above, at the time of the latest access (for tests, introspection)."""
        entry = self._entries[key]
        return entry.hits * math.exp(-self.decay * (self._now - entry.last)) * entry.cost

    def _priority(self, entry: _Entry) -> float:
        return math.log(entry.hits * entry.cost) + self.decay * entry.last

    def _on_access(self, entry: _Entry) -> None:
        self._now = entry.last = self._clock()


class GreedyDual(_HeapPolicy[K]):
    """GreedyDual (Young 1994), the classic cost-aware LRU: an entry's value is H = L + cost,
    set on insert and on every hit; evict the lowest H and raise the floor L to it. With equal
    costs it is LRU; a baseline for A2CR's cost awareness."""

    def __init__(self) -> None:
        super().__init__()
        self._floor = 0.0  # L

    def victim(self) -> K | None:
        key = super().victim()
        if key is not None:
            self._floor = self._entries[key].last
        return key

    def _priority(self, entry: _Entry) -> float:
        return entry.last

    def _on_access(self, entry: _Entry) -> None:
        entry.last = self._floor + entry.cost
