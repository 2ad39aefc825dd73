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

import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from redis import Redis

from wicore import keys
from wicore.errors import TooManyImages
from wicore.producer.admission import Admission
from wicore.producer.canceling import Canceler
from wicore.producer.claims import Claims
from wicore.producer.image_refs import prepare_image
from wicore.producer.outcome import Outcome
from wicore.producer.rq_records import RqWriter
from wicore.producer.submission import Prepared, ProducerConfig, Submission
from wicore.producer.waiting import OutcomeReader
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionJob, CaptionResult

T = TypeVar("T")


class Producer:
    """Submits jobs (`prepare` them, `Claims` the new ones, `RqWriter` writes them), reads and
    waits for their outcomes (`OutcomeReader`) and cancels them (`Canceler`)."""

    def __init__(
        self,
        connection: Redis | str,
        *,
        model: str,
        config: ProducerConfig | None = None,
        rules: ShapeRules | None = None,
        session: str | None = None,
    ):
        """`session`: names this producer's notification list and dedup marks (default: a new
        one); a caller that outlives its process (a gateway's batch) passes its own."""
        self.connection = Redis.from_url(connection) if isinstance(connection, str) else connection
        self.model = model
        self.config = config or ProducerConfig()
        self.rules = rules or ShapeRules()
        self.session = session or uuid.uuid4().hex
        self.notify_key = keys.notify(self.session)
        self.claims = Claims(self.connection, self.session, self.config)
        self.writer = RqWriter(self.connection, self.model, self.config, self.rules, self.notify_key)
        self.reader = OutcomeReader(self.connection, self.notify_key)
        self.canceler = Canceler(self.connection, self.session, self.config)
        caps = {"high": self.config.max_queued_high_jobs}
        caps |= {"normal": self.config.max_queued_jobs, "low": self.config.max_queued_jobs}
        self.admission = Admission(self.connection, caps)

    @property
    def connections(self) -> list[Redis]:
        """One, as `ShardedProducer.connections` lists its shards'."""
        return [self.connection]

    # -- submitting -------------------------------------------------------------------------

    def submit(self, image: str | bytes | None, prompt: str | None = None, **fields) -> str:
        return self.submit_many([Submission(image=image, prompt=prompt, **fields)])[0]

    def submit_many(self, submissions: Iterable[Submission], chunk: int = 256) -> list[str]:
        """One job id per submission, in order. Two round trips per chunk of at most `chunk`
        submissions (bounding the image bytes held in memory; `chunks` ramps up to it): claim the
        new ids and look up the blobs in one script call, then store the missing blobs and enqueue
        the new jobs in one transaction."""
        return [job_id for batch in chunks(submissions, chunk) for job_id in self._submit_chunk(batch)]

    def _submit_chunk(self, submissions: list[Submission]) -> list[str]:
        return self.enqueue_prepared([self.prepare(s) for s in submissions])

    def enqueue_prepared(self, prepared: list[Prepared]) -> list[str]:
        """Enqueue jobs made by `prepare` (a caller that wants each submission's own error
        prepares them one by one first). One job id per job, in order."""
        jobs = [p.job for p in prepared]
        blobs = {sha: data for p in prepared for sha, data in p.blobs.items()}
        new_ids, stored = self.claims.claim_new(jobs, list(blobs))
        new_jobs = list({job.job_id: job for job in jobs if job.job_id in new_ids}.values())
        self._admit(new_jobs)
        labels = {p.job.job_id: p.label for p in prepared}
        with self.connection.pipeline(transaction=True) as pipe:  # all of the chunk is enqueued, or none
            for sha in {image.sha256 for job in new_jobs for image in job.images if image.is_blob}:
                if sha in stored:
                    pipe.expire(keys.blob(sha), self.config.blob_ttl_s)
                else:
                    pipe.set(keys.blob(sha), blobs[sha], ex=self.config.blob_ttl_s)
            self.writer.enqueue(new_jobs, pipe, labels)
            pipe.execute()
        return [job.job_id for job in jobs]

    def _admit(self, jobs: list[CaptionJob]) -> None:
        """QueueFull when these new jobs would take a lane past its cap (work submitted again,
        already in Redis, is not counted). Their dedup marks stay: a mark without a job hash is
        enqueued by the next submission of the same work."""
        lanes = Counter(job.priority.value for job in jobs)
        self.admission.check(self.model, lanes, self.config.result_ttl_s)

    def prepare(self, submission: Submission) -> Prepared:
        """The job, the image bytes that travel as blobs, and its label. Raises ImageError, or
        pydantic's ValidationError for a submission that cannot become a job."""
        images = submission.all_images
        if len(images) > self.config.max_images_per_request:
            limit = self.config.max_images_per_request
            raise TooManyImages(f"{len(images)} images in one request; at most {limit} (max_images_per_request)")
        self.config.sampling.check(submission.params)
        refs, blobs = [], {}
        for image in images:
            ref, data = prepare_image(image, by_path=self.config.by_path, limit=self.config.max_image_bytes)
            refs.append(ref)
            if data is not None:
                blobs[ref.sha256] = data
        job = CaptionJob(
            images=tuple(refs),
            prompt=submission.prompt,
            messages=submission.messages,
            params=submission.generation,
            model=self.model,
            priority=submission.priority,
            deadline=submission.deadline,
            metadata=submission.metadata,
            nonce=uuid.uuid4().hex if submission.generation.unseeded_sampling else None,
        )
        return Prepared(job, blobs, submission.label)

    # -- results ----------------------------------------------------------------------------

    def outcome(self, job_id: str, timeout: float | None = None) -> Outcome:
        return self.reader.outcome(job_id, timeout)

    def poll(self, job_id: str) -> tuple[Outcome, str]:
        return self.reader.poll(job_id)

    def outcomes(self, job_ids: Sequence[str]) -> list[Outcome]:
        return self.reader.outcomes(job_ids)

    def result(self, job_id: str, timeout: float | None = None) -> CaptionResult:
        return self.reader.result(job_id, timeout)

    def wait(
        self,
        job_ids: Iterable[str],
        timeout: float | None = None,
        poll_s: float = 2.0,
        on_poll: Callable[[], None] | None = None,
    ) -> Iterator[Outcome]:
        return self.reader.wait(job_ids, timeout, poll_s, on_poll)

    # -- canceling --------------------------------------------------------------------------

    def cancel(self, job_ids: Iterable[str], *, own_queued_only: bool = False) -> dict[str, str]:
        return self.canceler.cancel(job_ids, own_queued_only=own_queued_only)


FIRST_CHUNK = 16  # the first chunk of a bulk submit: workers start on it while the rest is hashed


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """`items` in lists growing from FIRST_CHUNK, doubling, to `size` (the last one shorter),
    read lazily. Preparing a chunk reads and hashes each image (~2 ms for a 2.5 MB PNG), so a
    first chunk of 256 would keep every worker idle for half a second."""
    batch: list[T] = []
    want = min(FIRST_CHUNK, size)
    for item in items:
        batch.append(item)
        if len(batch) == want:
            yield batch
            batch, want = [], min(2 * want, size)
    if batch:
        yield batch
