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
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now

from wicore import defaults, keys, rq_keys
from wicore.errors import JobCanceled, JobFailed, ResultTimeout, TooManyImages, UnknownJob
from wicore.producer.admission import Admission
from wicore.producer.image_refs import prepare_image
from wicore.producer.outcome import Outcome, outcome_of
from wicore.producer.submission import Prepared, ProducerConfig, Submission
from wicore.redaction import masked_url
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionJob, CaptionResult

TASK = "wicore.worker.tasks.caption"  # by name: the producer never imports the worker
ENDED = frozenset({JobStatus.FINISHED.value, JobStatus.FAILED.value, JobStatus.STOPPED.value, JobStatus.CANCELED.value})
NO_ENTRY = "0-0"  # a stream id before every entry
MISSING = "missing"  # the status of an id with no job in Redis (never submitted, expired or deleted)
T = TypeVar("T")


def blob_shas(job: CaptionJob) -> list[str]:
    """The sha256s of the job's images that travel as blobs, each once."""
    return list(dict.fromkeys(image.sha256 for image in job.images if image.is_blob and image.sha256))


def _blob_uses(jobs: Sequence[CaptionJob], ids: list[str], shas: Sequence[str]) -> list[str | int]:
    """The mark script's per-blob arguments: each sha256, then the positions (1-based, in `ids`)
    of the jobs that use it."""
    position = {job_id: i + 1 for i, job_id in enumerate(ids)}
    users: dict[str, set[int]] = {sha: set() for sha in shas}
    for job in jobs:
        for sha in blob_shas(job):
            users.setdefault(sha, set()).add(position[job.job_id])
    return [item for sha, at in users.items() for item in (sha, len(at), *sorted(at))]


def _no_uses(shas: Sequence[str]) -> list[str | int]:
    """The mark script's per-blob arguments when no job joins its blobs' users: a lookup each."""
    return [item for sha in shas for item in (sha, 0)]


def result_stream(job_id: str) -> str:
    """The job's RQ result stream: workers add an entry when it ends (XREAD on it to wait)."""
    return Result.get_key(job_id)


# ARGV: this producer's session, the marks' TTL, the key prefixes of dedup marks, job hashes, blobs
# and blob users, the blobs' TTL, the number n of job ids, the n job ids, then per blob: its sha256,
# the number k of those jobs that use it and their k positions among the ids (1-based). Returns 1 or
# 0 per job id (enqueue it: its mark is new, or names no job hash), then per blob (it is in Redis
# already). The jobs to enqueue join their blobs' users (`keys.BLOB_USERS`) here, in the step that
# finds a blob stored, so that no worker ending a blob's last other user deletes it in between.
_MARK_LUA = """
local session, ttl, marks, jobs, blobs, users = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local blob_ttl, n = ARGV[7], tonumber(ARGV[8])
local out = {}
for i = 9, 8 + n do
  local new = redis.pcall('SET', marks .. ARGV[i], session, 'NX', 'EX', ttl)
  if type(new) == 'table' and new.err then  -- refused (maxmemory, a read-only replica): Redis' own error
    return redis.error_reply((string.gsub(new.err, '^@user_script:%s*%d+:%s*%-', '')))
  end
  out[#out + 1] = (new or redis.call('EXISTS', jobs .. ARGV[i]) == 0) and 1 or 0
end
local stored = {}
local i = 9 + n
while i <= #ARGV do
  local sha, k = ARGV[i], tonumber(ARGV[i + 1])
  local joining = {}
  for j = i + 2, i + 1 + k do
    local at = tonumber(ARGV[j])
    if out[at] == 1 then joining[#joining + 1] = ARGV[8 + at] end
  end
  if #joining > 0 then
    redis.call('SADD', users .. sha, unpack(joining))
    redis.call('EXPIRE', users .. sha, blob_ttl)
  end
  stored[#stored + 1] = redis.call('EXISTS', blobs .. sha)
  i = i + 2 + k
end
for _, flag in ipairs(stored) do out[#out + 1] = flag end
return out
"""


# ARGV: this producer's session, own-queued-only ('1' or '0'), now (unix), TTL of a canceled job
# and of a worker's cancel set, notify TTL, the key prefixes of notification lists, cancel sets
# and dedup marks, the job hash's run field (`keys.RUN_FIELD`), the key prefixes of blobs and blob
# users, then job ids. Returns each id's status afterwards:
# 'canceled', the status it keeps (ended, or not this producer's queued job when own-queued-only),
# or 'missing'. One call, so no worker claims a job between its check and its cancel; fields are
# read as plain strings (a job hash RQ could not restore cancels like any other). A canceled job
# is what RQ's `Job.cancel` makes of it (status, out of its queue and the started registry, in
# the canceled registry), its worker (if one started it) finds the run it stops (`keys.run`) in its
# cancel set, it leaves its blobs' users (a blob left with none goes), its dedup mark goes (submitting the same work again runs it, a new run that the old
# run's end leaves alone) and its producer's `wait` hears of it.
_CANCEL_LUA = (
    rq_keys.LUA_PREAMBLE
    + """
local session, own_only, now = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local ttl, notify_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local notify_prefix, cancel_prefix, marks, run_field = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local blobs, users = ARGV[10], ARGV[11]
local ended = {finished = 1, failed = 1, stopped = 1, canceled = 1}
local function expire(key, seconds)
  if seconds < 0 then redis.call('PERSIST', key) else redis.call('EXPIRE', key, math.max(seconds, 1)) end
end
local function notify_key(meta)
  local ok, decoded = pcall(cjson.decode, meta or '')
  local key = ok and type(decoded) == 'table' and decoded['notify']
  if type(key) == 'string' and #key <= 200 and string.sub(key, 1, #notify_prefix) == notify_prefix then return key end
  return nil
end
local function leave_blobs(id, meta)
  local ok, decoded = pcall(cjson.decode, meta or '')
  local shas = ok and type(decoded) == 'table' and decoded['blobs']
  if type(shas) ~= 'table' then return end
  for _, sha in ipairs(shas) do
    if type(sha) == 'string' and #sha == 64 and string.find(sha, '^%x+$') then
      redis.call('SREM', users .. sha, id)
      if redis.call('EXISTS', users .. sha) == 0 then redis.call('DEL', blobs .. sha) end
    end
  end
end
local function leave_registries(id, origin, status)
  redis.pcall('LREM', RQ.queue .. origin, 0, id)
  if status == 'started' then
    local eids = redis.pcall('ZRANGE', RQ.executions .. id, 0, -1)
    if type(eids) == 'table' and eids.err == nil then
      for _, eid in ipairs(eids) do redis.pcall('ZREM', RQ.started .. origin, id .. ':' .. eid) end
    end
  end
  redis.pcall('ZREM', RQ.deferred .. origin, id)
  redis.pcall('ZREM', RQ.scheduled .. origin, id)
  redis.pcall('ZADD', RQ.canceled .. origin, now, id)
end
local function cancel(id, job, f)
  redis.call('HSET', job, 'status', 'canceled')
  if f[2] then leave_registries(id, f[2], f[1]) end
  if f[1] == 'started' and f[3] and #f[3] <= 200 then
    redis.call('SADD', cancel_prefix .. f[3], f[5] and (id .. ':' .. f[5]) or id)
    expire(cancel_prefix .. f[3], ttl)
  end
  expire(job, ttl)
  leave_blobs(id, f[4])
  redis.call('DEL', marks .. id)
  local notify = notify_key(f[4])
  if notify then
    redis.call('RPUSH', notify, id)
    redis.call('EXPIRE', notify, notify_ttl)
  end
end
local out = {}
for i = 12, #ARGV do
  local id = ARGV[i]
  local job = RQ.job .. id
  if redis.call('TYPE', job)['ok'] ~= 'hash' then
    out[i - 11] = 'missing'
  else
    local f = redis.call('HMGET', job, 'status', 'origin', 'worker_name', 'meta', run_field)
    local mine = redis.pcall('GET', marks .. id) == session and f[1] == 'queued'
    if ended[f[1]] or (own_only and not mine) then
      out[i - 11] = f[1] or 'unknown'
    else
      cancel(id, job, f)
      out[i - 11] = 'canceled'
    end
  end
end
return out
"""
)


class Producer:
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
        self._cancel = self.connection.register_script(_CANCEL_LUA)
        self._mark = self.connection.register_script(_MARK_LUA)
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
        new_ids, stored = self._claim_new(jobs, list(blobs))
        new_jobs = list({job.job_id: job for job in jobs if job.job_id in new_ids}.values())
        self._admit(new_jobs)
        labels = {p.job.job_id: p.label for p in prepared}
        with self.connection.pipeline(transaction=True) as pipe:  # all of the chunk is enqueued, or none
            for sha in {image.sha256 for job in new_jobs for image in job.images if image.is_blob}:
                if sha in stored:
                    pipe.expire(keys.blob(sha), self.config.blob_ttl_s)
                else:
                    pipe.set(keys.blob(sha), blobs[sha], ex=self.config.blob_ttl_s)
            self._enqueue(new_jobs, pipe, labels)
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

    def _claim_new(self, jobs: Sequence[CaptionJob], blob_shas: Sequence[str]) -> tuple[set[str], set[str]]:
        """(ids to enqueue, blobs already in Redis), in one script call: only the first submission
        of a piece of work enqueues it (a failed or canceled job drops its mark, so resubmitting
        it runs it again), and joins its blobs' users. A mark without a job hash is a submission
        whose enqueue never happened (refused for memory or by admission control, or its producer
        died between the two round trips): that id is enqueued now."""
        unique = list(dict.fromkeys(job.job_id for job in jobs))
        prefixes = [keys.submitted(""), rq_keys.JOB, keys.blob(""), keys.blob_users("")]
        args = [self.session, self.config.result_ttl_s, *prefixes, self.config.blob_ttl_s, len(unique), *unique]
        uses = _blob_uses(jobs, unique, blob_shas) if self.config.release_blobs else _no_uses(blob_shas)
        flags = self._mark(args=[*args, *uses])
        new_ids = {job_id for job_id, flag in zip(unique, flags) if flag}
        return new_ids, {sha for sha, flag in zip(blob_shas, flags[len(unique) :]) if flag}

    def _enqueue(self, jobs: list[CaptionJob], pipe, labels: dict[str, str | None]) -> None:
        """RQ's records of queued jobs as `Queue.enqueue_many` writes them (tests/test_producer.py
        compares the two), in fewer commands: one HSET per job, one RPUSH and one SADD per queue,
        one DEL for the chunk (a rerun starts from a fresh hash and result stream: no fields or
        TTL left from its last end)."""
        by_queue: dict[str, list[CaptionJob]] = defaultdict(list)
        for job in jobs:
            by_queue[self.rules.bucket(job).queue_name].append(job)
        if jobs:
            pipe.delete(*(key for job in jobs for key in (rq_keys.JOB + job.job_id, result_stream(job.job_id))))
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

    # -- results ----------------------------------------------------------------------------

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

    # -- canceling --------------------------------------------------------------------------

    def cancel(self, job_ids: Iterable[str], *, own_queued_only: bool = False) -> dict[str, str]:
        """Cancel jobs as RQ's `Job.cancel` does: a queued job leaves its queue and never runs; a
        running one is stopped by its worker at the engine's next step boundary. Either reads
        'canceled', its dedup mark goes (submitting the same work again runs it) and its producer's
        `wait` hears of it. Returns each id's status afterwards: 'canceled', the status it had
        already ended with, or 'missing'. `own_queued_only`: cancel only the jobs this producer
        enqueued that no worker has started (what `wicore caption` takes back when it stops); the
        others keep their status. One server-side call (`_CANCEL_LUA`)."""
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        ttl = self.config.result_ttl_s
        args = [self.session, int(own_queued_only), time.time(), ttl, defaults.NOTIFY_TTL_S]
        args += [keys.NOTIFY_PREFIX, keys.CANCEL_PREFIX, keys.submitted(""), keys.RUN_FIELD]
        args += [keys.blob(""), keys.blob_users(""), *ids]
        statuses = self._cancel(args=args)
        return {job_id: raw.decode(errors="replace") for job_id, raw in zip(ids, statuses)}


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


def no_such_job(job_id: str) -> UnknownJob:
    return UnknownJob(f"no job {job_id} in Redis (never submitted, or expired)")


def describe_images(job: CaptionJob) -> str:
    """The job's images for people: the first one's path, URL (masked) or hash, and how many
    there are."""
    if not job.images:
        return "text only"
    ref = job.images[0]
    first = ref.path or (masked_url(ref.url) if ref.url is not None else (ref.sha256 or "")[:12])
    return first if len(job.images) == 1 else f"{first} and {len(job.images) - 1} more images"
