"""The batch former's policy, in plain Python (no Redis): given what every bucket queue holds,
which queue to take from, how many jobs, or how long to wait.

- A batch goes out when it is full (`max_batch_size`, or the engine's free slots if fewer),
  or when its oldest job has waited `max_queue_delay_s` (Triton's `max_queue_delay`: a
  partly filled batch is sent once its first request has waited that long).
- Lanes are drained in order (high, normal, low); within a lane the bucket whose head job is
  oldest goes first, so no bucket starves while it has the oldest work.
- The last `high_lane_slots` free slots of the engine are the high lane's: bulk work never fills
  them, so a high-lane job is taken at once even while bulk work keeps the engine full (the
  engine then runs it ahead of the bulk work it holds).
- A job past its deadline is failed with the reason and never run (`split_expired`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from wicore import defaults
from wicore.scheduler.buckets import BucketKey
from wicore.schemas import Lane

T = TypeVar("T")
HIGH_LANE_SHARE = 16  # by default one slot in 16 is kept for the high lane (none below 16 slots)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = defaults.BATCH_SIZE
    max_queue_delay_s: float = defaults.MAX_QUEUE_DELAY_S
    high_lane_slots: int | None = None  # None: max_batch_size // HIGH_LANE_SHARE

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be >= 0, got {self.max_queue_delay_s}")
        if not 0 <= self.reserved < self.max_batch_size:
            raise ValueError(f"high_lane_slots must be >= 0 and < max_batch_size, got {self.high_lane_slots}")

    @property
    def reserved(self) -> int:
        """Free slots only the high lane may take."""
        return self.max_batch_size // HIGH_LANE_SHARE if self.high_lane_slots is None else self.high_lane_slots

    def room(self, lane: Lane, capacity: int) -> int:
        """Jobs a bucket of `lane` may take when the engine has `capacity` free slots."""
        free = capacity if lane is Lane.HIGH else capacity - self.reserved
        return min(free, self.max_batch_size)


@dataclass(frozen=True)
class QueueHead:
    """What the batch former knows of one bucket queue."""

    bucket: BucketKey
    length: int
    oldest_at: float  # enqueue time of the job at the head (unix seconds)

    @property
    def order(self) -> tuple[int, float]:
        return (self.bucket.lane.rank, self.oldest_at)


@dataclass(frozen=True)
class Take:
    queue_name: str
    count: int


@dataclass(frozen=True)
class Wait:
    seconds: float


def choose(heads: Iterable[QueueHead], capacity: int, policy: BatchPolicy, now: float) -> Take | Wait | None:
    """Take from the first ready bucket in drain order; else wait for the earliest to ripen.

    None when there is nothing to do (no jobs, or no room in the engine for the lanes that have
    them)."""
    waiting = sorted((h for h in heads if h.length > 0), key=lambda h: h.order)
    open_heads = [(head, want) for head in waiting if (want := policy.room(head.bucket.lane, capacity)) > 0]
    if not open_heads:
        return None
    for head, want in open_heads:
        if head.length >= want or now - head.oldest_at >= policy.max_queue_delay_s:
            return Take(head.bucket.queue_name, min(head.length, want))
    return Wait(min(policy.max_queue_delay_s - (now - head.oldest_at) for head, _ in open_heads))


def split_expired(items: Iterable[T], deadline_of: Callable[[T], float | None], now: float) -> tuple[list[T], list[T]]:
    """(live, expired): an item whose deadline is set and has passed is expired."""
    live: list[T] = []
    expired: list[T] = []
    for item in items:
        deadline = deadline_of(item)
        (expired if deadline is not None and deadline <= now else live).append(item)
    return live, expired
