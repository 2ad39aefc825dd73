"""What every route shares: Redis connections (one per shard of a comma-separated redis_url), one
producer per model, the live workers, the metrics, and the wait for a job's end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from wicore.gateway.disconnect import ClientGone, client_gone
from wicore.gateway.errors import ApiError
from wicore.gateway.file_store import FilesConfig
from wicore.gateway.metrics import GatewayMetrics
from wicore.gateway.results import ResultReader
from wicore.gateway.workers import live_models
from wicore.producer import Outcome, Producer, ProducerConfig
from wicore.producer.shards import ShardedProducer, producer_over, shard_of

WAIT_SLICE_S = 1.0  # a waiter re-reads the job's status this often (a cancel writes no result)
WORKERS_TTL_S = 2.0  # how long a read of the live workers is reused by the per-request model check


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str  # several comma-separated: independent shards (producer/shards.py)
    model: str  # jobs without a model go to this one; readiness asks for a worker serving it
    allowed_roots: tuple[Path, ...] = ()
    api_keys: frozenset[str] = frozenset()
    max_request_bytes: int = 64 * 2**20
    request_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 60.0  # a streamed answer ends after this long with no new text
    stream_cancel_on_disconnect: bool = True  # a streamed completion's client hanging up cancels its job
    producer: ProducerConfig = field(default_factory=lambda: ProducerConfig(by_path=True, notify=False))
    files: FilesConfig = field(default_factory=FilesConfig)  # where uploaded and batch output files live
    batch_window_s: float = 86_400.0  # how long a batch's "24h" completion window lasts


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        urls = config.redis_url.split(",")
        self.connections = [Redis.from_url(url) for url in urls]
        self.quick = [AsyncRedis.from_url(url) for url in urls]  # short commands from the event loop
        self.readers = [
            ResultReader(AsyncRedis.from_url(url, single_connection_client=True), quick)
            for url, quick in zip(urls, self.quick)
        ]
        self.metrics = GatewayMetrics(self.connections)
        self._producers: dict[str, Producer | ShardedProducer] = {}
        self._models: tuple[float, dict[str, int]] = (float("-inf"), {})

    def reader_for(self, job_id: str) -> ResultReader:
        """The result reader of the shard that holds the job."""
        return self.readers[shard_of(job_id, len(self.readers))]

    def quick_for(self, job_id: str) -> AsyncRedis:
        """The short-command connection of the shard that holds the job (its token stream too)."""
        return self.quick[shard_of(job_id, len(self.quick))]

    def producer(self, model: str | None = None) -> Producer | ShardedProducer:
        """The producer for `model` (default: the gateway's). Another model must be served by a
        live worker: a typo would otherwise queue jobs no one takes."""
        name = model or self.config.model
        if name != self.config.model and name not in self.live_models(cached=True):
            served = ", ".join(sorted(self.live_models(cached=True))) or "none"
            raise ApiError(404, f"model {name!r} is not served by any live worker (served: {served})", param="model")
        if name not in self._producers:
            self._producers[name] = producer_over(self.connections, model=name, config=self.config.producer)
        return self._producers[name]

    def live_models(self, cached: bool = False) -> dict[str, int]:
        """model -> number of live workers serving it (a worker is live while its RQ key lives)."""
        read_at, models = self._models
        if cached and time.monotonic() - read_at < WORKERS_TTL_S:
            return models
        models = live_models(self.connections)
        self._models = (time.monotonic(), models)
        return models

    async def wait(self, job_id: str, seconds: float, request: Request | None = None) -> Outcome:
        """The job's outcome once it ends, or as it is after `seconds`; `ClientGone` as soon as
        `request`'s client hangs up. Between its reads of the job it holds no thread and no
        pooled connection: the gateway's one result reader wakes it (`ResultReader`)."""
        deadline = time.monotonic() + seconds
        producer = self.producer()
        outcome, last_seen = await run_in_threadpool(producer.poll, job_id)
        if outcome.done or seconds <= 0:
            return outcome
        async with self.reader_for(job_id).watching(job_id, last_seen) as arrived, client_gone(request) as gone:
            while (left := deadline - time.monotonic()) > 0:
                await first_set((arrived, gone), min(left, WAIT_SLICE_S))
                if gone.is_set():
                    raise ClientGone()
                arrived.clear()
                outcome, _ = await run_in_threadpool(producer.poll, job_id)
                if outcome.done:
                    break
        return outcome

    async def close(self) -> None:
        for reader, quick, connection in zip(self.readers, self.quick, self.connections):
            await reader.close()
            await quick.aclose()
            connection.close()


async def first_set(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Until one of `events` is set, or `timeout` seconds."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
