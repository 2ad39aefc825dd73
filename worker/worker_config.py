"""What a batching worker is told (`WorkerConfig`), what it reports (`WorkerState`), and the
record it keeps of each job in hand (`InFlight`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from wicore import defaults
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import CaptionJob
from wicore.worker.job_inputs import InputConfig, Loaded
from wicore.worker.rq_bridge import Claimed


class WorkerState(str, Enum):
    """What a readiness probe reports."""

    STARTING = "starting"
    READY = "ready"
    WAITING_FOR_REDIS = "waiting for Redis"
    STOPPING = "stopping"


@dataclass(frozen=True)
class WorkerConfig:
    model_id: str
    name: str | None = None
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    inputs: InputConfig = field(default_factory=InputConfig)
    liveness_ttl_s: float = defaults.LIVENESS_TTL_S  # a worker silent this long is dead; its jobs are requeued
    heartbeat_s: float = 3.0
    reap_every_s: float = 5.0
    idle_wait_s: float = 1.0  # longest doorbell wait before looking at the queues again
    result_ttl_s: int = defaults.RESULT_TTL_S
    burst: bool = False  # exit once the queues are empty and the engine is idle
    max_jobs: int | None = None  # exit after this many jobs ended (tests, benchmarks)

    def jobs_wanted(self, done: int, in_hand: int) -> int:
        """Jobs the worker may still take (`max_jobs`), beside the engine's room."""
        return sys.maxsize if self.max_jobs is None else self.max_jobs - done - in_hand

    @property
    def maintain_every_s(self) -> float:
        """Reaping and reconciling run at least three times per liveness TTL."""
        return min(self.reap_every_s, self.liveness_ttl_s / 3)


@dataclass
class InFlight:
    claimed: Claimed
    payload: CaptionJob
    batch: int  # its handover group: jobs claimed together reach the engine in groups (`Engine.handover_size`)
    fetched: bool = False  # its image bytes were asked of Redis (an outage can come between)
    loading: Future[Loaded] | None = None  # the image, until it reaches the engine
    preprocess_s: float = 0.0


def overtaking_loads(flights: Iterable[InFlight]) -> list[InFlight]:
    """Jobs loading their images whose lane is better than that of a job in the engine."""
    flights = list(flights)
    in_engine = [f.payload.priority.rank for f in flights if f.fetched and f.loading is None]
    if not in_engine:
        return []
    return [f for f in flights if f.loading is not None and f.payload.priority.rank < max(in_engine)]


def loads_to_wait_for(loading: list[InFlight], overtaking: list[InFlight]) -> list[Future[Loaded]]:
    """What the engine waits for while nothing else may run: a better lane's loads first, else
    every image of the oldest handover group (its jobs reach the engine together)."""
    oldest = min(f.batch for f in loading)
    ahead = overtaking or [f for f in loading if f.batch == oldest]
    return [f.loading for f in ahead if f.loading is not None and not f.loading.done()]
