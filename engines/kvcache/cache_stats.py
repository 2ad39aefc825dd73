"""Per-tier cache counters: hits, misses, bytes, evictions, corrupt entries and time spent.

The engine's stats report carries them as plain dicts (`to_dict`), which the worker publishes
for `wicore status`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # written into this tier
    bytes_out: int = 0  # read back out of it (hits only)
    evictions: int = 0
    corrupt: int = 0  # entries found damaged and dropped (counted as misses too)
    seconds: float = 0.0  # host time spent in the tier's calls (on CUDA: enqueueing, not copying)

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def record(self, hits: int, misses: int, bytes_out: int = 0) -> None:
        self.hits += hits
        self.misses += misses
        self.bytes_out += bytes_out

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"hit_rate": self.hit_rate}


@dataclass
class CacheStats:
    """Counters of each prefix-cache tier by name: "gpu", "host", "disk"."""

    tiers: dict[str, TierStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {name: stats.to_dict() for name, stats in self.tiers.items()}
