"""Every use of RQ internals lives here; tests/test_rq_bridge.py pins each record we write
against RQ's own readers (Job.fetch, results, registries, Worker.all, executions).

RQ has no API to take or finish several jobs at once, and its per-job Python bookkeeping costs
more than the work of a small job. So the common paths run server-side, one Lua call per batch:

- `claim`: LMOVE up to N job ids from a bucket queue into this worker's claims list (a job RQ
  has canceled is dropped, never started; a cancel request this worker holds for an id is older
  than the claim and dropped too), mark each started exactly as RQ's worker does (job
  status/started_at/worker_name, an execution hash, the job's execution registry, the queue's
  started registry, the worker's executions index) and return the fields the worker needs.
- `finish` (successes): status finished, the RQ result stream entry, the finished registry,
  TTLs, execution records removed, worker counters, claims list and producer notifications.
  A job canceled while it ran (`Job.cancel` set its status and its canceled-registry entry) ends
  through the same call with no result: only its execution records and claim are removed. A
  failure of such a job stays canceled too (no retry, not counted as failed).

Failures, retries and requeues are rare and go through RQ's own Python methods.
The scripts touch keys they compute (rq:job:<id>, ...): fine on one Redis, not on Redis Cluster.
"""

from __future__ import annotations

import json
import uuid
import zlib
from base64 import b64encode
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from rq import Queue
from rq.defaults import DEFAULT_WORKER_TTL
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.worker import BaseWorker, WorkerStatus

from wicore import defaults, keys

# A started job's execution records live as long as RQ's SimpleWorker keeps them
# (`get_heartbeat_ttl`, `Execution.create`): the job's timeout (RQ's queue default when the job
# has none) plus a grace, or RQ's worker TTL for a job that never times out (timeout -1).
DEFAULT_JOB_TIMEOUT = Queue.DEFAULT_TIMEOUT
NO_TIMEOUT_TTL = DEFAULT_WORKER_TTL
TTL_GRACE_S = 60  # RQ adds it to every execution TTL; rq spells it as a literal, not a constant

# KEYS: queue, claims list, worker executions index, worker hash, claimants set, worker cancel set.
# ARGV: count, worker name, now (unix), now (RQ text), default job timeout, TTL of a job without
# timeout, TTL grace, then `count` fresh execution ids.
_CLAIM_LUA = """
local n, worker, now, now_text = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4]
local default_timeout, no_timeout_ttl, grace = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local out, longest = {}, 0
redis.call('SADD', KEYS[5], worker)
for i = 1, n do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  local job = 'rq:job:' .. id
  local f = redis.call('HMGET', job, 'data', 'meta', 'origin', 'retries_left', 'result_ttl', 'timeout', 'status')
  -- A cancel request this worker holds for the id predates this claim: it was for an earlier run.
  redis.call('SREM', KEYS[6], id)
  if not f[1] or f[7] == 'canceled' then
    redis.call('LREM', KEYS[2], 1, id)
  else
    local eid = ARGV[7 + i]
    local comp = id .. ':' .. eid
    local timeout = tonumber(f[6]) or default_timeout
    local ttl = timeout + grace
    if timeout == -1 then ttl = no_timeout_ttl end
    if ttl > longest then longest = ttl end
    redis.call('HSET', job, 'status', 'started', 'started_at', now_text, 'last_heartbeat', now_text,
               'worker_name', worker)
    redis.call('PERSIST', job)
    redis.call('HSET', 'rq:execution:' .. comp, 'id', eid, 'job_id', id, 'created_at', ARGV[3],
               'last_heartbeat', ARGV[3], 'worker_name', worker)
    redis.call('EXPIRE', 'rq:execution:' .. comp, ttl)
    redis.call('ZADD', 'rq:executions:' .. id, now + ttl + grace, eid)
    redis.call('EXPIRE', 'rq:executions:' .. id, ttl + grace)
    redis.call('ZADD', 'rq:wip:' .. f[3], now + ttl, comp)
    redis.call('SADD', KEYS[3], comp)
    out[#out + 1] = {id, eid, f[1], f[2] or '', f[3], f[4] or '', f[5] or ''}
  end
end
if #out > 0 then
  redis.call('EXPIRE', KEYS[3], longest + grace)
  redis.call('HSET', KEYS[4], 'state', 'busy')
end
return out
"""

# KEYS: claims list, worker executions index, worker hash.
# ARGV: worker name, now (unix), now (RQ text), notify TTL, then 7 per job:
#   id, execution id, origin, result ttl, return value (b64 JSON), started (unix), notify key.
_FINISH_OK_LUA = """
local worker, now, now_text, notify_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local worked, succeeded = 0, 0
for i = 5, #ARGV, 7 do
  local id, eid, origin, ttl = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local started, notify = tonumber(ARGV[i + 5]), ARGV[i + 6]
  local job, results, comp = 'rq:job:' .. id, 'rq:results:' .. id, id .. ':' .. eid
  if redis.call('HGET', job, 'status') ~= 'canceled' then
    succeeded = succeeded + 1
    redis.call('HSET', job, 'status', 'finished', 'ended_at', now_text)
    redis.call('XADD', results, 'MAXLEN', '~', 10, '*', 'type', 1, 'worker_name', worker,
               'return_value', ARGV[i + 4], 'execution_id', eid,
               'execution_started_at', ARGV[i + 5], 'execution_ended_at', ARGV[2])
    if ttl == 0 then
      redis.call('DEL', job, results)
    elseif ttl < 0 then
      redis.call('PERSIST', results)
      redis.call('ZADD', 'rq:finished:' .. origin, '+inf', id)
    else
      redis.call('EXPIRE', results, ttl)
      redis.call('EXPIRE', job, ttl)
      redis.call('ZADD', 'rq:finished:' .. origin, now + ttl, id)
    end
  end
  redis.call('DEL', 'rq:execution:' .. comp)
  redis.call('ZREM', 'rq:wip:' .. origin, comp)
  redis.call('ZREM', 'rq:executions:' .. id, eid)
  redis.call('SREM', KEYS[2], comp)
  redis.call('LREM', KEYS[1], 1, id)
  if notify ~= '' then
    redis.call('RPUSH', notify, id)
    redis.call('EXPIRE', notify, notify_ttl)
  end
  worked = worked + (now - started)
end
redis.call('HINCRBY', KEYS[3], 'successful_job_count', succeeded)
redis.call('HINCRBYFLOAT', KEYS[3], 'total_working_time', worked)
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('HSET', KEYS[3], 'state', 'idle') end
return 1
"""

# KEYS[1] queue list; ARGV job ids. Put claimed-but-unstarted jobs back at the head, unless
# something (RQ's own cleanup, another reaper) already did.
_UNCLAIM_LUA = """
for i = #ARGV, 1, -1 do
  if not redis.call('LPOS', KEYS[1], ARGV[i]) then
    redis.call('LPUSH', KEYS[1], ARGV[i])
  end
end
return #ARGV
"""


class RQWorkerRecord(BaseWorker):
    """RQ's view of a wicore worker: registration, heartbeats, state, counters and the
    executions index, which `rq info` and rq-dashboard read. RQ's own `work()` loop is not
    used: wicore.worker.loop runs batches."""

    def execute_job(self, job: Job, queue: Queue) -> None:
        raise NotImplementedError("wicore workers run batches (wicore.worker.loop)")

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
    retries_left: int | None
    result_ttl: int | None
    started_at: float  # unix seconds

    @property
    def notify(self) -> str:
        return str(self.meta.get("notify") or "")


@dataclass
class Finished:
    """How one claimed job ended."""

    claimed: Claimed
    result: dict[str, Any] | None = None  # JSON-able return value
    error: str | None = None
    retry: bool = False  # transient failure: run it again if it has retries left
    canceled: bool = False  # RQ canceled it while it ran (only after `Job.cancel` committed)


def decode_claimed(row: list[bytes], started_at: float) -> Claimed:
    job_id, eid, data, meta, origin, retries_left, result_ttl = (v.decode() if i != 2 else v for i, v in enumerate(row))
    try:
        _, _, args, _ = json.loads(zlib.decompress(data))
    except zlib.error:
        _, _, args, _ = json.loads(data)
    return Claimed(
        id=job_id,
        execution_id=eid,
        origin=origin,
        args=args,
        meta=json.loads(meta) if meta else {},
        retries_left=int(retries_left) if retries_left else None,
        result_ttl=int(result_ttl) if result_ttl else None,
        started_at=started_at,
    )


class RQBridge:
    def __init__(self, record: RQWorkerRecord, *, result_ttl: int = defaults.RESULT_TTL_S):
        self.record = record
        self.connection: Redis = record.connection
        self.result_ttl = result_ttl
        self.claims_key = keys.claims(record.name)
        self._claim = self.connection.register_script(_CLAIM_LUA)
        self._finish_ok = self.connection.register_script(_FINISH_OK_LUA)
        self._unclaim = self.connection.register_script(_UNCLAIM_LUA)

    def _worker_keys(self) -> list[str]:
        return [self.claims_key, self.record.executions_key, self.record.key]

    # -- taking jobs --------------------------------------------------------------------------

    def claim(self, queue_name: str, count: int) -> list[Claimed]:
        """Take and start up to `count` jobs from a bucket queue, in one round trip."""
        at = now()
        args = [
            count,
            self.record.name,
            at.timestamp(),
            utcformat(at),
            DEFAULT_JOB_TIMEOUT,
            NO_TIMEOUT_TTL,
            TTL_GRACE_S,
        ]
        args += [uuid.uuid4().hex for _ in range(count)]
        claim_keys = ["rq:queue:" + queue_name, *self._worker_keys(), keys.CLAIMANTS, keys.cancel(self.record.name)]
        rows = self._claim(keys=claim_keys, args=args)
        return [decode_claimed(row, at.timestamp()) for row in rows]

    # -- finishing jobs -----------------------------------------------------------------------

    def finish(self, items: list[Finished]) -> None:
        """Successes and cancellations in one Lua call; failures and retries through RQ's own
        methods."""
        ok = [item for item in items if item.result is not None or item.canceled]
        if ok:
            self._finish_successes(ok)
        failed = [item for item in items if item.result is None and not item.canceled]
        if failed:
            self._finish_failures(failed)

    def _finish_successes(self, items: list[Finished]) -> None:
        at = now()
        args: list[Any] = [self.record.name, at.timestamp(), utcformat(at), defaults.NOTIFY_TTL_S]
        for item in items:
            c = item.claimed
            ttl = c.result_ttl if c.result_ttl is not None else self.result_ttl
            value = b64encode(JSONSerializer.dumps(item.result)).decode() if item.result is not None else ""
            args += [c.id, c.execution_id, c.origin, ttl, value, c.started_at, c.notify]
        self._finish_ok(keys=self._worker_keys(), args=args)

    def _finish_failures(self, items: list[Finished]) -> None:
        jobs = Job.fetch_many([i.claimed.id for i in items], connection=self.connection, serializer=JSONSerializer)
        with self.connection.pipeline() as pipe:  # MULTI ... EXEC
            for item, job in zip(items, jobs):
                if job is not None and job.get_status(refresh=False) == JobStatus.CANCELED:
                    self._forget_executions(job, pipe)  # canceled while it ran: stays canceled, never retried
                elif job is not None:
                    self._fail_or_retry(item, job, pipe)
                pipe.lrem(self.claims_key, 1, item.claimed.id)
            pipe.execute()
        if not self.connection.scard(self.record.executions_key):
            self.record.set_state(WorkerStatus.IDLE)

    def _fail_or_retry(self, item: Finished, job: Job, pipe) -> None:
        c = item.claimed
        job.started_at = datetime.fromtimestamp(c.started_at, tz=UTC)
        job.ended_at = now()
        execution = Execution(c.execution_id, c.id, self.connection, worker_name=self.record.name)
        execution.created_at = job.started_at
        retry = item.retry and bool(job.retries_left)
        if retry:
            job.retry(Queue(job.origin, connection=self.connection, serializer=JSONSerializer), pipe)
        else:
            self._fail(job, execution, item.error or "failed", pipe)
        self.record.increment_failed_job_count(pipe)
        self.record.increment_total_working_time(job.ended_at - job.started_at, pipe)
        execution.delete(job=job, pipeline=pipe)
        if c.notify and not retry:
            pipe.rpush(c.notify, c.id)
            pipe.expire(c.notify, defaults.NOTIFY_TTL_S)

    def _fail(self, job: Job, execution: Execution | None, message: str, pipe) -> None:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        job._handle_failure(
            message,
            pipe,
            worker_name=self.record.name,
            execution_id=execution.id if execution else None,
            execution_started_at=execution.created_at if execution else None,
            execution_ended_at=job.ended_at,
        )
        pipe.delete(keys.submitted(job.id))  # resubmitting a failed job runs it again

    # -- giving jobs back ---------------------------------------------------------------------

    def requeue_claims(self, claims_key: str) -> int:
        """Return a claims list's jobs to their queues: unstarted ones to the head as they
        were; started ones (their worker died or stopped running them) through RQ's retry,
        or failed once their retries are spent. Returns how many jobs were handled."""
        ids = [i.decode() for i in self.connection.lrange(claims_key, 0, -1)]
        jobs = [j for j in Job.fetch_many(ids, connection=self.connection, serializer=JSONSerializer) if j]
        unstarted: dict[str, list[str]] = {}
        with self.connection.pipeline() as pipe:
            for job in jobs:
                status = job.get_status(refresh=False)
                if status == JobStatus.QUEUED:
                    unstarted.setdefault(job.origin, []).append(job.id)
                elif status == JobStatus.STARTED:
                    self._forget_executions(job, pipe)
                    self._retry_abandoned(job, pipe)
                elif status == JobStatus.CANCELED:  # canceled while its worker held it: stays canceled
                    self._forget_executions(job, pipe)
            pipe.delete(claims_key)
            pipe.execute()
        for origin, job_ids in unstarted.items():
            self._unclaim(keys=["rq:queue:" + origin], args=job_ids)
        return len(jobs)

    def _retry_abandoned(self, job: Job, pipe) -> None:
        job.ended_at = now()
        if job.retries_left:
            job.retry(Queue(job.origin, connection=self.connection, serializer=JSONSerializer), pipe)
        else:
            self._fail(job, None, "WorkerDied: the worker running this job stopped (no retries left)", pipe)

    def _forget_executions(self, job: Job, pipe) -> None:
        """Drop every execution record of `job`, so RQ's started-registry cleanup never treats
        the job as abandoned again once it runs elsewhere."""
        for raw in self.connection.zrange(f"rq:executions:{job.id}", 0, -1):
            Execution(raw.decode(), job.id, self.connection).delete(job=job, pipeline=pipe)
