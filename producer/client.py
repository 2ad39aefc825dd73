"""The client other services import: submit caption jobs, get results.

    from wicore.producer import Producer
    producer = Producer("redis://...", model="democap")
    job_id = producer.submit("cat.jpg", "Describe this image in detail.")
    print(producer.result(job_id, timeout=60).text)

Jobs are RQ jobs (JSON serializer, never pickle) in the queue of their shape bucket. Image bytes
go to Redis once, by content hash; a job id is derived from its content, so submitting the same
work again returns the same id and runs nothing new.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence

from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from wicore import keys
from wicore.errors import JobFailed, ResultTimeout, UnknownJob
from wicore.producer.image_refs import prepare_image
from wicore.producer.outcome import Outcome, outcome_of
from wicore.producer.submission import ProducerConfig, Submission
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionJob, CaptionResult

TASK = "wicore.worker.tasks.caption"  # by name: the producer never imports the worker

# ARGV: this producer's session, the dedup marks' key prefix, then job ids. A job goes only if
# its mark is this session's, its status is queued and its id was still in its queue (LREM; a
# key of another type answers an error, which pcall turns into "not there").
_CANCEL_LUA = """
local session, marks, taken = ARGV[1], ARGV[2], 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local job = 'rq:job:' .. id
  local f = redis.call('HMGET', job, 'status', 'origin')
  if redis.call('GET', marks .. id) == session and f[1] == 'queued' and f[2] then
    local removed = redis.pcall('LREM', 'rq:queue:' .. f[2], 0, id)
    if type(removed) == 'number' and removed > 0 then
      redis.call('DEL', job, 'rq:results:' .. id, job .. ':dependents', job .. ':dependencies', marks .. id)
      taken = taken + 1
    end
  end
end
return taken
"""


class Producer:
    def __init__(
        self,
        connection: Redis | str,
        *,
        model: str,
        config: ProducerConfig | None = None,
        rules: ShapeRules | None = None,
    ):
        self.connection = Redis.from_url(connection) if isinstance(connection, str) else connection
        self.model = model
        self.config = config or ProducerConfig()
        self.rules = rules or ShapeRules()
        self.session = uuid.uuid4().hex
        self.notify_key = keys.notify(self.session)
        self._cancel = self.connection.register_script(_CANCEL_LUA)

    # -- submitting -------------------------------------------------------------------------

    def submit(self, image: str | bytes, prompt: str | None = None, **fields) -> str:
        return self.submit_many([Submission(image=image, prompt=prompt, **fields)])[0]

    def submit_many(self, submissions: Iterable[Submission], chunk: int = 256) -> list[str]:
        """One job id per submission, in order. Two round trips per chunk of `chunk` submissions
        (bounding the image bytes held in memory): claim the new ids and look up the blobs, then
        store the missing blobs and enqueue the new jobs in one pipeline."""
        ids: list[str] = []
        batch: list[Submission] = []
        for submission in submissions:
            batch.append(submission)
            if len(batch) == chunk:
                ids += self._submit_chunk(batch)
                batch = []
        return ids + (self._submit_chunk(batch) if batch else [])

    def _submit_chunk(self, submissions: list[Submission]) -> list[str]:
        prepared = [self._prepare(s) for s in submissions]
        jobs = [job for job, _ in prepared]
        blobs = {job.image.sha256: data for job, data in prepared if data is not None}
        new_ids, stored = self._claim_new([job.job_id for job in jobs], list(blobs))
        new_jobs = list({job.job_id: job for job in jobs if job.job_id in new_ids}.values())
        labels = {job.job_id: s.label for job, s in zip(jobs, submissions)}
        with self.connection.pipeline(transaction=True) as pipe:  # all of the chunk is enqueued, or none
            for sha in {job.image.sha256 for job in new_jobs if job.image.is_blob}:
                if sha in stored:
                    pipe.expire(keys.blob(sha), self.config.blob_ttl_s)
                else:
                    pipe.set(keys.blob(sha), blobs[sha], ex=self.config.blob_ttl_s)
            self._enqueue(new_jobs, pipe, labels)
            pipe.execute()
        return [job.job_id for job in jobs]

    def _prepare(self, submission: Submission) -> tuple[CaptionJob, bytes | None]:
        """The job, and the image bytes when they travel as a blob."""
        ref, data = prepare_image(submission.image, by_path=self.config.by_path, limit=self.config.max_image_bytes)
        job = CaptionJob(
            image=ref,
            prompt=submission.prompt,
            messages=submission.messages,
            params=submission.params,
            model=self.model,
            priority=submission.priority,
            deadline=submission.deadline,
            metadata=submission.metadata,
        )
        return job, data

    def _claim_new(self, job_ids: Sequence[str], blob_shas: Sequence[str]) -> tuple[set[str], set[str]]:
        """(ids to enqueue, blobs already in Redis). SET NX per id: only the first submission of
        a piece of work enqueues it (a failed job drops its mark, so resubmitting it runs it
        again). A mark without a job hash is a submission whose enqueue never happened (refused
        for memory, or its producer died between the two round trips): that id is enqueued now."""
        unique = list(dict.fromkeys(job_ids))
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in unique:
                pipe.set(keys.submitted(job_id), self.session, nx=True, ex=self.config.result_ttl_s)
                pipe.exists(f"rq:job:{job_id}")
            for sha in blob_shas:
                pipe.exists(keys.blob(sha))
            replies = pipe.execute()
        marks, present = replies[: 2 * len(unique)], replies[2 * len(unique) :]
        new_ids = {job_id for job_id, first, job in zip(unique, marks[::2], marks[1::2]) if first or not job}
        return new_ids, {sha for sha, n in zip(blob_shas, present) if n}

    def _enqueue(self, jobs: list[CaptionJob], pipe, labels: dict[str, str | None]) -> None:
        by_queue: dict[str, list[CaptionJob]] = defaultdict(list)
        for job in jobs:
            by_queue[self.rules.bucket(job).queue_name].append(job)
        for queue_name, queue_jobs in by_queue.items():
            queue = Queue(queue_name, connection=self.connection, serializer=JSONSerializer)
            pipe.delete(*(f"rq:results:{job.job_id}" for job in queue_jobs))  # a rerun starts a fresh stream
            queue.enqueue_many([self._rq_data(job, labels.get(job.job_id)) for job in queue_jobs], pipeline=pipe)
        if jobs:
            bell = keys.doorbell(self.model)
            pipe.lpush(bell, *(["1"] * min(len(jobs), 16)))
            pipe.ltrim(bell, 0, 63)
            pipe.expire(bell, 60)

    def _rq_data(self, job: CaptionJob, label: str | None):
        return Queue.prepare_data(
            TASK,
            args=[job.model_dump(mode="json")],
            job_id=job.job_id,
            timeout=self.config.job_timeout_s,
            result_ttl=self.config.result_ttl_s,
            failure_ttl=self.config.failure_ttl_s,
            retry=Retry(max=self.config.retries) if self.config.retries else None,
            meta={"notify": self.notify_key},
            description=f"caption {label or job.image.path or job.image.sha256[:12]}",
        )

    def cancel(self, job_ids: Iterable[str]) -> int:
        """Take back the jobs this producer enqueued that no worker has started: removed from
        their queue and Redis, with their dedup mark, so submitting the same work again enqueues
        it anew. Jobs enqueued by another producer, or already started, are left alone. One
        server-side call: a worker cannot claim a job between its check and its removal, and no
        job hash is parsed here. Returns how many were removed."""
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return 0
        return int(self._cancel(args=[self.session, keys.submitted(""), *ids]))

    # -- results ----------------------------------------------------------------------------

    def outcome(self, job_id: str, timeout: float | None = None) -> Outcome:
        """The job's outcome now; with `timeout`, block on its RQ result stream (XREAD, no
        polling) until it ends or the time is up. A 'retried' entry is not an end."""
        if not self.connection.exists(f"rq:job:{job_id}"):
            raise UnknownJob(f"no job {job_id} in Redis (never submitted, or expired)")
        # Only the id and the status are read: a job hash that RQ could not restore still has
        # its outcome in the result stream (the worker fails unreadable jobs with the reason).
        job = Job(job_id, connection=self.connection, serializer=JSONSerializer)
        deadline = time.monotonic() + (timeout or 0.0)
        last_seen = "0-0"
        while True:
            latest = Result.fetch_latest(job, serializer=JSONSerializer)
            status = self.connection.hget(f"rq:job:{job_id}", "status")
            outcome = outcome_of(job_id, status.decode(errors="replace") if status else "unknown", latest)
            left = deadline - time.monotonic()
            if outcome.done or left <= 0:
                return outcome
            last_seen = latest.id if latest else last_seen
            # Block in slices: redis-py's default socket timeout (5 s) would cut a longer wait.
            self.connection.xread({Result.get_key(job_id): last_seen}, block=max(1, int(min(left, 2.0) * 1000)))

    def result(self, job_id: str, timeout: float | None = None) -> CaptionResult:
        """The job's result; raises JobFailed, ResultTimeout or UnknownJob."""
        outcome = self.outcome(job_id, timeout)
        if outcome.error is not None:
            raise JobFailed(job_id, outcome.error)
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
                pipe.hget(f"rq:job:{job_id}", "status")
            statuses = pipe.execute()
        ended = {JobStatus.FINISHED.value, JobStatus.FAILED.value, JobStatus.STOPPED.value, JobStatus.CANCELED.value}
        outcomes = []
        for job_id, status in zip(ids, statuses):
            if status is None:
                outcomes.append(Outcome(job_id, "missing", error="job no longer in Redis (expired or deleted)"))
            elif status.decode() in ended:
                outcomes.append(self.outcome(job_id))
        return outcomes
