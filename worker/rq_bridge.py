"""Every use of RQ internals lives here; tests/test_rq_bridge.py pins each record we write
against RQ's own readers (Job.fetch, results, registries, Worker.all, executions).

RQ has no API to take or finish several jobs at once, its per-job Python bookkeeping costs more
than the work of a small job, and its `Job.restore` raises on a malformed field. So every change
to a job's records runs server-side, one Lua call per batch (worker/rq_scripts.py):

- `claim`: LPOP up to N job ids from a bucket queue and mark each started exactly as RQ's worker
  does; each start is a run (`keys.run`: job id and a fresh execution id), held in this worker's
  claims set and named in the job hash as its current run. Ids that name no job go to a
  dead-letter stream; a job canceled while its id sat in the queue is dropped unrun.
- `finish`: results, failures, retries and cancellations, matched by run: only for runs still in
  this worker's claims set, so it may be repeated (after a lost reply, or when Redis is back
  after an outage), and only for the job's current run (a job canceled and submitted again while
  the old run was still in hand is the new run's). A job canceled while it ran
  (`Producer.cancel`) ends with no result, and a failure of it stays canceled (no retry, not
  counted as failed).
- `requeue`: a dead worker's claims, or our own orphans, back to the head of their queues.

The fields a claim returns are parsed here, defensively: a job whose record cannot be read is
failed with the reason (`Claimed.invalid`); nothing is ever unpickled. RQ's Python classes are used
for the worker's own record (registration, heartbeat, queue names).
"""

from __future__ import annotations

import json
import uuid
import zlib
from base64 import b64encode
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue
from rq.defaults import DEFAULT_FAILURE_TTL, DEFAULT_WORKER_TTL
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from wicore import defaults, keys, rq_keys
from wicore.errors import InvalidJob
from wicore.producer.rq_records import TASK
from wicore.worker import rq_scripts

# A started job's execution records live as long as RQ's SimpleWorker keeps them
# (`get_heartbeat_ttl`, `Execution.create`): the job's timeout (RQ's queue default when the job
# has none) plus a grace, or RQ's worker TTL for a job that never times out (timeout -1).
DEFAULT_JOB_TIMEOUT = Queue.DEFAULT_TIMEOUT
NO_TIMEOUT_TTL = DEFAULT_WORKER_TTL
TTL_GRACE_S = 60  # RQ adds it to every execution TTL; rq spells it as a literal, not a constant
MAX_JOB_DATA = 16 * 2**20  # bytes of a job's (inflated) data we are willing to parse
WORKER_DIED = "WorkerDied: the worker running this job stopped (no retries left)"


class RQWorkerRecord(BaseWorker):
    """RQ's view of a wicore worker: registration, heartbeats, state, counters and the
    executions index, which `rq info` and rq-dashboard read. RQ's own `work()` loop is not
    used: wicore.worker.loop runs batches."""

    def execute_job(self, job: Job, queue: Queue) -> None:
        raise NotImplementedError("wicore workers run batches (wicore.worker.loop)")

    def register_again(self) -> None:
        """RQ's registration for a worker whose record Redis lost, or kept only in part (a
        FLUSHALL; a settle's counters then make a hash of a few fields): this process is that
        worker, so what is left of its record goes first."""
        self.connection.delete(self.key)
        self.register_birth()

    def set_queue_names(self, names: list[str]) -> None:
        """Bucket queues appear while the worker runs; keep RQ's record of them current."""
        if names == self.queue_names():
            return
        self.queues = [Queue(n, connection=self.connection, serializer=self.serializer) for n in names]
        self._ordered_queues = self.queues[:]
        self.connection.hset(self.key, "queues", ",".join(names))


@dataclass
class Claimed:
    """A job this worker took and started: what the worker needs of RQ's job hash."""

    id: str
    execution_id: str
    origin: str
    args: list[Any]
    meta: dict[str, Any]
    result_ttl: int | None
    started_at: float  # unix seconds
    invalid: str | None = None  # why the job's record cannot be run, if it cannot

    @property
    def run(self) -> str:
        """This run of the job: its key in the worker's hands, claims set and cancel set."""
        return keys.run(self.id, self.execution_id)

    @property
    def notify(self) -> str:
        """The producer's notification list; anything else in `meta` is not a key we push to."""
        key = self.meta.get("notify")
        ok = isinstance(key, str) and key.startswith(keys.NOTIFY_PREFIX) and len(key) <= 200
        return key if ok else ""


@dataclass
class Finished:
    """How one claimed job ended."""

    claimed: Claimed
    result: dict[str, Any] | None = None  # JSON-able return value
    error: str | None = None
    retry: bool = False  # transient failure: run it again if it has retries left
    canceled: bool = False  # RQ canceled it while it ran (only after `Job.cancel` committed)


# -- reading a claimed job's fields ---------------------------------------------------------------


def decode_claimed(row: list[bytes], started_at: float) -> Claimed:
    """Never raises: a field that does not parse makes the job `invalid`, with the reason."""
    job_id, eid, data, meta, origin, result_ttl = row
    claimed = Claimed(
        id=job_id.decode(),  # the claim script only returns ids of [A-Za-z0-9_-]
        execution_id=eid.decode(),
        origin=origin.decode(),  # the queue it was claimed from
        args=[],
        meta={},
        result_ttl=optional_int(result_ttl),
        started_at=started_at,
    )
    try:
        claimed.meta = job_meta(meta)
        claimed.args = job_args(data)
    except InvalidJob as exc:
        claimed.invalid = f"{InvalidJob.__name__}: {exc}"
    return claimed


def job_args(data: bytes) -> list[Any]:
    """The args of RQ's JSON-serialized (function, instance, args, kwargs), zlib'd or not."""
    if not data:
        raise InvalidJob("the job hash has no data")
    decoded = json_field(inflate(data), "data")
    if not (isinstance(decoded, list) and len(decoded) == 4):
        raise InvalidJob("data is not RQ's [function, instance, args, kwargs]")
    function, _, args, _ = decoded
    if function != TASK:
        raise InvalidJob(f"data names the function {str(function)[:80]!r}, not {TASK}")
    if not isinstance(args, list) or len(args) != 1:
        raise InvalidJob("data's args must be exactly one caption job")
    return args


def job_meta(meta: bytes) -> dict[str, Any]:
    if not meta:
        return {}
    decoded = json_field(meta, "meta")
    if not isinstance(decoded, dict):
        raise InvalidJob("meta is not a JSON object")
    return decoded


def inflate(data: bytes) -> bytes:
    """RQ compresses job data with zlib (and reads uncompressed data as is); a bomb stops at
    MAX_JOB_DATA."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, MAX_JOB_DATA)
    except zlib.error:
        return data
    if inflater.unconsumed_tail:
        raise InvalidJob(f"data inflates past {MAX_JOB_DATA} bytes")
    return raw


def json_field(raw: bytes, name: str) -> Any:
    if len(raw) > MAX_JOB_DATA:
        raise InvalidJob(f"{name} is over {MAX_JOB_DATA} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting past the stack
        raise InvalidJob(f"{name} is not JSON ({type(exc).__name__}); wicore jobs are never pickled") from None


def optional_int(raw: bytes) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def settle_kind(item: Finished) -> str:
    """The settle script's kind for a job that ended without a result."""
    if item.canceled:
        return "cancel"
    return "retry" if item.retry else "fail"


def exc_string(message: str) -> str:
    """RQ's encoding of a failure's text in its result stream."""
    return b64encode(zlib.compress(message.encode(errors="replace"))).decode()


# -- the bridge -----------------------------------------------------------------------------------


class RQBridge:
    def __init__(self, record: RQWorkerRecord, *, result_ttl: int = defaults.RESULT_TTL_S):
        self.record = record
        self.connection: Redis = record.connection
        self.result_ttl = result_ttl
        self.claims_key = keys.claims(record.name)
        self._claim = self.connection.register_script(rq_scripts.CLAIM)
        self._settle = self.connection.register_script(rq_scripts.SETTLE)
        self._requeue = self.connection.register_script(rq_scripts.REQUEUE)

    def _worker_keys(self) -> list[str]:
        return [self.claims_key, self.record.executions_key, self.record.key]

    def claim(self, queue_name: str, count: int) -> list[Claimed]:
        """Take and start up to `count` jobs from a bucket queue, in one round trip."""
        if count < 1:
            return []
        at = now()
        args = [count, self.record.name, at.timestamp(), utcformat(at), queue_name]
        args += [DEFAULT_JOB_TIMEOUT, NO_TIMEOUT_TTL, TTL_GRACE_S, *(uuid.uuid4().hex for _ in range(count))]
        claim_keys = [rq_keys.QUEUE + queue_name, *self._worker_keys(), keys.CLAIMANTS, keys.DEAD_LETTER]
        rows = self._claim(keys=claim_keys, args=args)
        return [decode_claimed(row, at.timestamp()) for row in rows]

    def finish(self, items: list[Finished]) -> int:
        """Write how each job ended, in one round trip. Runs no longer claimed by this worker
        (requeued by a reaper, or finished by an earlier call) are skipped, and so are jobs that
        moved on to another run; returns how many were written."""
        if not items:
            return 0
        at = now()
        args: list[Any] = [self.record.name, at.timestamp(), utcformat(at), DEFAULT_FAILURE_TTL, defaults.NOTIFY_TTL_S]
        for item in items:
            args += self._settle_args(item)
        return int(self._settle(keys=self._worker_keys(), args=args))

    def _settle_args(self, item: Finished) -> list[Any]:
        c = item.claimed
        if item.result is not None:
            kind, value = "ok", b64encode(JSONSerializer.dumps(item.result)).decode()
        else:
            kind, value = settle_kind(item), exc_string(item.error or "failed")
        ttl = c.result_ttl if c.result_ttl is not None else self.result_ttl
        return [c.id, c.execution_id, c.origin, kind, value, ttl, c.started_at, c.notify]

    def requeue(self, claims_key: str, runs: list[str] | None = None, *, died: bool, owner: str | None = None) -> int:
        """Return jobs of a claims set to the heads of their queues: those of `runs`, or the whole
        set (which is then deleted). `died`: their worker died holding them, so each spends a retry
        (a job out of retries fails as WorkerDied) and a job that kills its workers ends. With
        `owner`, nothing happens if that worker is registered again (-1). Returns how many jobs
        were handled."""
        if runs == []:
            return 0
        name = owner or self.record.name
        script_keys = [claims_key, rq_keys.worker_executions(name)]
        if owner is not None:
            script_keys.append(rq_keys.WORKER + owner)
        at = now()
        args = [at.timestamp(), utcformat(at), int(died), exc_string(WORKER_DIED), self.record.name]
        args += [DEFAULT_FAILURE_TTL, *(runs or [])]
        return int(self._requeue(keys=script_keys, args=args))

    def claimed_runs(self) -> list[str]:
        """The runs this worker holds, in the order it claimed them (its claims set is scored so)."""
        return [raw.decode(errors="replace") for raw in self.connection.zrange(self.claims_key, 0, -1)]

    def prune_registries(self, queue_names: list[str]) -> None:
        """Drop expired entries of the finished and failed registries (RQ's own worker does this
        in its maintenance; ours writes those registries in Lua and so prunes them too)."""
        cutoff = now().timestamp()
        with self.connection.pipeline(transaction=False) as pipe:
            for name in queue_names:
                pipe.zremrangebyscore(rq_keys.FINISHED + name, 0, cutoff)
                pipe.zremrangebyscore(rq_keys.FAILED + name, 0, cutoff)
            pipe.execute()
