"""Caption jobs spread over independent Redis shards, for when one Redis is not enough.

Each shard is a whole RQ world: its own queues, registries, workers, results and dedup marks. A
job lives on the shard its id hashes to (`shard_of`), so whoever holds a job id and the shard list
finds the job there: `Job.fetch` on `connection_for(job_id)`, results, cancels. Submitting the same
work again lands on the same shard, so deduplication stays exact. Workers are not sharded: each
serves one shard (`wicore worker --redis-url` of that shard), and its claims, heartbeats and the
reaping of its dead peers never leave it. README.md ("Past one Redis") has the plan and its numbers.

    producer = ShardedProducer(["redis://a:6379/0", "redis://b:6379/0"], model="democap")
    ids = producer.submit_many(Submission(p) for p in paths)
    for outcome in producer.wait(ids):
        ...
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from redis import Redis

from wicore.errors import ConfigError
from wicore.producer.client import Producer, chunks
from wicore.producer.outcome import Outcome
from wicore.producer.submission import Prepared, ProducerConfig, Submission
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionResult

T = TypeVar("T")
_DONE = object()  # a shard's waiter ended


class _Stopped(Exception):
    """The reader of `ShardedProducer.wait` went away: its shard waiters stop at their next poll."""


def shard_of(job_id: str, count: int) -> int:
    """The shard a job lives on, the same for every producer and reader: CRC32 of its id. The shard
    list is part of a deployment: changing its length moves ids to other shards."""
    return zlib.crc32(job_id.encode()) % count


class ShardedProducer:
    """`Producer`'s interface over several Redis servers, one `Producer` per shard."""

    def __init__(
        self,
        connections: Sequence[Redis | str],
        *,
        model: str,
        config: ProducerConfig | None = None,
        rules: ShapeRules | None = None,
    ):
        if not connections:
            raise ConfigError("a sharded producer needs at least one Redis URL")
        self.shards = [Producer(c, model=model, config=config, rules=rules) for c in connections]
        self.model = model
        self.config = self.shards[0].config

    @property
    def connections(self) -> list[Redis]:
        return [shard.connection for shard in self.shards]

    def shard_for(self, job_id: str) -> Producer:
        return self.shards[shard_of(job_id, len(self.shards))]

    def connection_for(self, job_id: str) -> Redis:
        """The Redis that holds the job: RQ's readers (`Job.fetch`, registries) work there."""
        return self.shard_for(job_id).connection

    def submit(self, image: str | bytes, prompt: str | None = None, **fields) -> str:
        return self.submit_many([Submission(image=image, prompt=prompt, **fields)])[0]

    def submit_many(self, submissions: Iterable[Submission], chunk: int = 256) -> list[str]:
        """One job id per submission, in order; a chunk costs each shard it touches the two round
        trips `Producer.enqueue_prepared` costs."""
        return [job_id for batch in chunks(submissions, chunk) for job_id in self._submit_chunk(batch)]

    def _submit_chunk(self, batch: list[Submission]) -> list[str]:
        return self.enqueue_prepared([self.prepare(s) for s in batch])

    def prepare(self, submission: Submission) -> Prepared:
        return self.shards[0].prepare(submission)  # no Redis: only the id and the image

    def enqueue_prepared(self, prepared: list[Prepared]) -> list[str]:
        """`Producer.enqueue_prepared` on each shard the jobs hash to. Shards are independent: a
        refusal (QueueFull, Redis) on one leaves the groups sent to the shards before it enqueued."""
        for index, group in self._by_shard(prepared, lambda p: p.job.job_id).items():
            self.shards[index].enqueue_prepared(group)
        return [p.job.job_id for p in prepared]

    def poll(self, job_id: str) -> tuple[Outcome, str]:
        return self.shard_for(job_id).poll(job_id)

    def outcome(self, job_id: str, timeout: float | None = None) -> Outcome:
        return self.shard_for(job_id).outcome(job_id, timeout)

    def result(self, job_id: str, timeout: float | None = None) -> CaptionResult:
        return self.shard_for(job_id).result(job_id, timeout)

    def cancel(self, job_ids: Iterable[str], *, own_queued_only: bool = False) -> dict[str, str]:
        statuses: dict[str, str] = {}
        for index, ids in self._by_shard(list(dict.fromkeys(job_ids)), str).items():
            statuses |= self.shards[index].cancel(ids, own_queued_only=own_queued_only)
        return statuses

    def wait(
        self,
        job_ids: Iterable[str],
        timeout: float | None = None,
        poll_s: float = 2.0,
        on_poll: Callable[[], None] | None = None,
    ) -> Iterator[Outcome]:
        """Yield each job's outcome as it ends, from every shard at once: a thread per shard blocks
        on that shard's notification list (`Producer.wait`). Raises what a shard's wait raises
        (ResultTimeout after `timeout`), and what `on_poll` raises (called every `poll_s` here,
        in the reader's thread)."""
        groups = self._by_shard(list(dict.fromkeys(job_ids)), str)
        ended: queue.Queue = queue.Queue()
        stop = threading.Event()
        waiters = [
            threading.Thread(
                target=self._wait_one, args=(self.shards[i], ids, timeout, poll_s, ended, stop), daemon=True
            )
            for i, ids in groups.items()
        ]
        for waiter in waiters:
            waiter.start()
        try:
            yield from _merge(ended, len(waiters), poll_s, on_poll)
        finally:
            stop.set()

    @staticmethod
    def _wait_one(
        producer: Producer, ids: list[str], timeout, poll_s: float, ended: queue.Queue, stop: threading.Event
    ) -> None:
        def check() -> None:
            if stop.is_set():
                raise _Stopped

        try:
            for outcome in producer.wait(ids, timeout, poll_s=poll_s, on_poll=check):
                ended.put(outcome)
        except _Stopped:
            pass
        except Exception as exc:  # handed to the reader, who raises it
            ended.put(exc)
        finally:
            ended.put(_DONE)

    def _by_shard(self, items: Iterable[T], job_id: Callable[[T], str]) -> dict[int, list[T]]:
        groups: dict[int, list[T]] = defaultdict(list)
        for item in items:
            groups[shard_of(job_id(item), len(self.shards))].append(item)
        return groups


def producer_over(
    connections: Sequence[Redis | str], *, model: str, config: ProducerConfig | None = None
) -> Producer | ShardedProducer:
    """A `Producer` for one Redis, a `ShardedProducer` for several: the same interface."""
    if len(connections) == 1:
        return Producer(connections[0], model=model, config=config)
    return ShardedProducer(connections, model=model, config=config)


def _merge(ended: queue.Queue, waiters: int, poll_s: float, on_poll: Callable[[], None] | None) -> Iterator[Outcome]:
    while waiters:
        try:
            item = ended.get(timeout=poll_s)
        except queue.Empty:
            if on_poll is not None:
                on_poll()
            continue
        if item is _DONE:
            waiters -= 1
        elif isinstance(item, Exception):
            raise item
        else:
            yield item
