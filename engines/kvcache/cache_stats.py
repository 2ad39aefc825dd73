"""Per-tier cache counters: hits, misses, bytes, evictions, corrupt entries and time spent.

Counters from several engines or workers add up (`+`), and serialise to JSON for
`wicore status`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields


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

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"hit_rate": self.hit_rate}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> TierStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # hit_rate is derived


@dataclass
class CacheStats:
    """Counters of every tier by name, e.g. "gpu", "host", "disk", "vision", "vision_shared"."""

    tiers: dict[str, TierStats] = field(default_factory=dict)

    def tier(self, name: str) -> TierStats:
        return self.tiers.setdefault(name, TierStats())

    def __add__(self, other: CacheStats) -> CacheStats:
        names = list(dict.fromkeys([*self.tiers, *other.tiers]))
        return CacheStats({n: self.tiers.get(n, TierStats()) + other.tiers.get(n, TierStats()) for n in names})

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {name: stats.to_dict() for name, stats in self.tiers.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CacheStats:
        return cls({name: TierStats.from_dict(d) for name, d in json.loads(text).items()})
