"""Reading jobs' outcomes and waiting for them to end."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from redis import Redis
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from wicore import rq_keys
from wicore.errors import JobCanceled, JobFailed, ResultTimeout, UnknownJob
from wicore.producer.outcome import Outcome, outcome_of
from wicore.producer.rq_records import result_stream
from wicore.schemas import CaptionResult

ENDED = frozenset({JobStatus.FINISHED.value, JobStatus.FAILED.value, JobStatus.STOPPED.value, JobStatus.CANCELED.value})
NO_ENTRY = "0-0"  # a stream id before every entry
MISSING = "missing"  # the status of an id with no job in Redis (never submitted, expired or deleted)


@dataclass(frozen=True)
class OutcomeReader:
    """Reads jobs' outcomes from one Redis and waits for them: on a job's RQ result stream, or on
    the notification list `notify_key` that the workers of a producer's jobs push to."""

    connection: Redis
    notify_key: str

    def outcome(self, job_id: str, timeout: float | None = None) -> Outcome:
        """The job's outcome now; with `timeout`, block on its RQ result stream (XREAD, no
        polling) until it ends or the time is up. A 'retried' entry is not an end."""
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            outcome, last_seen = self.poll(job_id)
            left = deadline - time.monotonic()
            if outcome.done or left <= 0:
                return outcome
            # Block in slices: redis-py's default socket timeout (5 s) would cut a longer wait.
            self.connection.xread({result_stream(job_id): last_seen}, block=max(1, int(min(left, 2.0) * 1000)))

    def poll(self, job_id: str) -> tuple[Outcome, str]:
        """The job's outcome now, and the id of the newest entry of its result stream: a waiter
        blocks on `result_stream(job_id)` for entries after it."""
        if not self.connection.exists(rq_keys.JOB + job_id):
            raise no_such_job(job_id)
        # Only the id and the status are read: a job hash that RQ could not restore still has
        # its outcome in the result stream (the worker fails unreadable jobs with the reason).
        job = Job(job_id, connection=self.connection, serializer=JSONSerializer)
        latest = Result.fetch_latest(job, serializer=JSONSerializer)
        # The status is read after the result: read before it, a job that ended in between
        # would show its result under its old status.
        status = self.connection.hget(job.key, "status")
        outcome = outcome_of(job_id, status.decode(errors="replace") if status else "unknown", latest)
        return outcome, latest.id if latest else NO_ENTRY

    def outcomes(self, job_ids: Sequence[str]) -> list[Outcome]:
        """Each job's outcome now, read in one round trip (status and latest result of each);
        an id with no job reads 'missing'."""
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(result_stream(job_id), "+", "-", count=1)
                pipe.hget(f"rq:job:{job_id}", "status")
            replies = pipe.execute()
        return [self._outcome_read(job_id, *replies[2 * i : 2 * i + 2]) for i, job_id in enumerate(job_ids)]

    def _outcome_read(self, job_id: str, entries: list, status: bytes | None) -> Outcome:
        if status is None:
            return Outcome(job_id, MISSING, error="job no longer in Redis (expired or deleted)")
        try:
            latest = None
            if entries:
                entry_id, payload = entries[0]
                latest = Result.restore(job_id, entry_id.decode(), payload, self.connection, JSONSerializer)
            return outcome_of(job_id, status.decode(errors="replace"), latest)
        except (ValueError, TypeError, KeyError, zlib.error) as exc:  # a result record we cannot read
            return Outcome(job_id, status.decode(errors="replace"), error=f"unreadable result ({exc})")

    def result(self, job_id: str, timeout: float | None = None) -> CaptionResult:
        """The job's result; raises JobFailed (JobCanceled), ResultTimeout or UnknownJob."""
        outcome = self.outcome(job_id, timeout)
        if outcome.error is not None:
            raise (JobCanceled if outcome.canceled else JobFailed)(job_id, outcome.error)
        if outcome.result is None:
            raise ResultTimeout(f"job {job_id} is {outcome.status} after waiting {timeout or 0}s")
        return outcome.result

    def wait(
        self,
        job_ids: Iterable[str],
        timeout: float | None = None,
        poll_s: float = 2.0,
        on_poll: Callable[[], None] | None = None,
    ) -> Iterator[Outcome]:
        """Yield each job's outcome as it ends (in completion order). Blocks on this producer's
        notification list; a status sweep every `poll_s` catches jobs enqueued by someone else
        (and calls `on_poll`, which may raise to give up, e.g. when the workers died)."""
        pending = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        next_sweep = 0.0
        while pending:
            if time.monotonic() >= next_sweep:
                if on_poll is not None:
                    on_poll()
                for outcome in self._sweep(pending):
                    pending.discard(outcome.job_id)
                    yield outcome
                next_sweep = time.monotonic() + poll_s
                continue
            left = next_sweep - time.monotonic()
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
                if left <= 0:
                    raise ResultTimeout(f"{len(pending)} jobs unfinished after {timeout}s")
            popped = self.connection.blpop([self.notify_key], timeout=max(0.01, left))
            if popped and popped[1].decode() in pending:
                job_id = popped[1].decode()
                pending.discard(job_id)
                yield self.outcome(job_id)

    def _sweep(self, pending: set[str]) -> list[Outcome]:
        ids = list(pending)
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(rq_keys.JOB + job_id, "status")
            statuses = pipe.execute()
        outcomes = []
        for job_id, status in zip(ids, statuses):
            if status is None:
                outcomes.append(Outcome(job_id, MISSING, error="job no longer in Redis (expired or deleted)"))
            elif status.decode() in ENDED:
                outcomes.append(self.outcome(job_id))
        return outcomes


def no_such_job(job_id: str) -> UnknownJob:
    return UnknownJob(f"no job {job_id} in Redis (never submitted, or expired)")
