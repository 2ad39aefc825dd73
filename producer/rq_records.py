"""A caption job as RQ's own records: the job hash, its queue entry and its result stream."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now

from wicore import keys, rq_keys
from wicore.producer.claims import blob_shas
from wicore.producer.submission import ProducerConfig
from wicore.redaction import masked_url
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionJob

TASK = "wicore.worker.tasks.caption"  # by name: the producer never imports the worker


def result_stream(job_id: str) -> str:
    """The job's RQ result stream: workers add an entry when it ends (XREAD on it to wait)."""
    return Result.get_key(job_id)


def job_keys(job: CaptionJob) -> tuple[str, ...]:
    """A job's keys that a rerun starts without: its hash, result stream and, for one that
    streams, its token stream."""
    own = (rq_keys.JOB + job.job_id, result_stream(job.job_id))
    return (*own, keys.tokens(job.job_id)) if job.params.stream else own


@dataclass(frozen=True)
class RqWriter:
    """Writes a producer's new jobs into Redis as RQ's own records of queued jobs."""

    connection: Redis
    model: str
    config: ProducerConfig
    rules: ShapeRules
    notify_key: str

    def enqueue(self, jobs: list[CaptionJob], pipe, labels: dict[str, str | None]) -> None:
        """RQ's records of queued jobs as `Queue.enqueue_many` writes them (tests/test_producer.py
        compares the two), in fewer commands: one HSET per job, one RPUSH and one SADD per queue,
        one DEL for the chunk (a rerun starts from a fresh hash and result stream: no fields or
        TTL left from its last end)."""
        by_queue: dict[str, list[CaptionJob]] = defaultdict(list)
        for job in jobs:
            by_queue[self.rules.bucket(job).queue_name].append(job)
        if jobs:
            pipe.delete(*(key for job in jobs for key in job_keys(job)))
        for queue_name, queue_jobs in by_queue.items():
            queue = Queue(queue_name, connection=self.connection, serializer=JSONSerializer)
            for job in queue_jobs:
                self._rq_job(queue, job, labels.get(job.job_id)).save(pipeline=pipe)
            pipe.rpush(queue.key, *(job.job_id for job in queue_jobs))
            pipe.sadd(queue.redis_queues_keys, queue.key)
        if jobs:
            bell = keys.doorbell(self.model)
            pipe.lpush(bell, *(["1"] * min(len(jobs), 16)))
            pipe.ltrim(bell, 0, 63)
            pipe.expire(bell, 60)

    def _rq_job(self, queue: Queue, job: CaptionJob, label: str | None) -> Job:
        """The job as RQ's enqueue prepares it (`Queue._prepare_for_queue`), ready to save."""
        rq_job = queue.create_job(
            TASK,
            args=[job.model_dump(mode="json")],
            job_id=job.job_id,
            timeout=self.config.job_timeout_s,
            result_ttl=self.config.result_ttl_s,
            failure_ttl=self.config.failure_ttl_s,
            retry=Retry(max=self.config.retries) if self.config.retries else None,
            meta=self._meta(job),
            description=f"caption {label or describe_images(job)}",
            status=JobStatus.QUEUED,
        )
        rq_job.enqueued_at = now()
        rq_job.redis_server_version = queue.get_redis_server_version()
        return rq_job

    def _meta(self, job: CaptionJob) -> dict[str, object]:
        """The RQ meta of a job: the list its worker notifies, the blobs whose users it joins."""
        meta: dict[str, object] = {"notify": self.notify_key} if self.config.notify else {}
        shas = blob_shas(job) if self.config.release_blobs else []
        return meta | {keys.META_BLOBS: shas} if shas else meta


def describe_images(job: CaptionJob) -> str:
    """The job's images for people: the first one's path, URL (masked) or hash, and how many
    there are."""
    if not job.images:
        return "text only"
    ref = job.images[0]
    first = ref.path or (masked_url(ref.url) if ref.url is not None else (ref.sha256 or "")[:12])
    return first if len(job.images) == 1 else f"{first} and {len(job.images) - 1} more images"
