"""Every Redis key wicore writes beside RQ's own `rq:*` keys, in one place."""

from __future__ import annotations

PREFIX = "wicore"

# Image bytes stored once by content hash (the producer writes, workers read).
BLOB = PREFIX + ":blob:{sha256}"
# The ids of the unfinished jobs that use the blob of this sha256 (a set): a producer adds a job in
# the script that finds the blob stored; the job's end (its run's final settle, a cancel, the
# reaper failing it) removes it, and the blob goes with the last one. Ids, not a count: removing
# an id twice (a run settled twice, a job ended by a cancel and then by its worker) changes nothing.
BLOB_USERS = PREFIX + ":blobusers:{sha256}"
# The key of a job's meta (RQ's, JSON) naming the blobs it uses, for the scripts that end it.
META_BLOBS = "blobs"
# Set when a job id is first submitted; makes resubmission of the same work a no-op.
SUBMITTED = PREFIX + ":submitted:{job_id}"
# The runs (`run`: job id:execution id) a worker has taken from a queue and not yet completed (a
# sorted set per worker, scored in claim order).
CLAIMS = PREFIX + ":claims:{worker}"
# Worker names that may hold claims; the reaper walks it.
CLAIMANTS = PREFIX + ":claimants"
# Pushed by producers after enqueueing, popped by idle workers (a wake-up, not a queue).
DOORBELL = PREFIX + ":doorbell:{model}"
# Completion notices for a waiting producer (a list per producer session).
NOTIFY_PREFIX = PREFIX + ":notify:"
NOTIFY = NOTIFY_PREFIX + "{session}"
# Queue entries that name no job a worker could fail through RQ's records (a stream: id, queue,
# reason, worker, at).
DEAD_LETTER = PREFIX + ":dead-letter"
# Runs a worker must stop (a set per worker, of `run`s): `Producer.cancel` adds, the worker takes them.
CANCEL_PREFIX = PREFIX + ":cancel:"
CANCEL = CANCEL_PREFIX + "{worker}"
# Per-worker model, engine, device and dtype, engine and cache counters (JSON), for `wicore status`.
STATS = PREFIX + ":stats:{worker}"
# Set and deleted at once by a verb's start-up check that Redis takes writes; set with a 1 s TTL by
# a worker testing whether Redis takes writes again during an outage.
PROBE = PREFIX + ":probe:{token}"

# Text deltas of a job that streams (a Redis stream per job: entries {at, text}, at most one per
# engine step; capped length, a TTL), written by the worker, read by the gateway.
TOKENS = PREFIX + ":tokens:{job_id}"

# A field wicore adds to RQ's job hash: the execution id of the job's current run, set when a
# worker starts it. A run's settle, requeue or cancel touches the job only while it is the current
# run (a job canceled and submitted again, or requeued and taken by another worker, has moved on).
RUN_FIELD = PREFIX + "_execution"

# RQ queue names of wicore's bucket queues start with this (see scheduler.buckets).
QUEUE_PREFIX = PREFIX


def blob(sha256: str) -> str:
    return BLOB.format(sha256=sha256)


def blob_users(sha256: str) -> str:
    return BLOB_USERS.format(sha256=sha256)


def submitted(job_id: str) -> str:
    return SUBMITTED.format(job_id=job_id)


def tokens(job_id: str) -> str:
    return TOKENS.format(job_id=job_id)


def claims(worker: str) -> str:
    return CLAIMS.format(worker=worker)


def doorbell(model: str) -> str:
    return DOORBELL.format(model=model)


def notify(session: str) -> str:
    return NOTIFY.format(session=session)


def stats(worker: str) -> str:
    return STATS.format(worker=worker)


def cancel(worker: str) -> str:
    return CANCEL.format(worker=worker)


def run(job_id: str, execution_id: str) -> str:
    """One run of a job: RQ's composite key of an execution (`Execution.composite_key`), the
    member of a worker's claims set and cancel set."""
    return f"{job_id}:{execution_id}"


def probe(token: str) -> str:
    return PROBE.format(token=token)


# OpenAI files and batches (the gateway's Batch API). A file's metadata (a hash: the FileObject's
# fields), its bytes when the Redis store holds them, and every file id by creation time.
FILE = PREFIX + ":file:{file_id}"
FILE_DATA = PREFIX + ":file-data:{file_id}"
FILES = PREFIX + ":files"
# A batch's record (a hash: the Batch object's fields and its progress), every batch id by
# creation time, the ids not yet ended, the lines waiting on each job (job id -> JSON
# [[line, custom_id], ...]) and the lease of the gateway driving it.
BATCH = PREFIX + ":batch:{batch_id}"
BATCHES = PREFIX + ":batches"
BATCHES_ACTIVE = PREFIX + ":batches:active"
BATCH_PENDING = PREFIX + ":batch:{batch_id}:pending"
BATCH_LEASE = PREFIX + ":batch:{batch_id}:lease"


def file(file_id: str) -> str:
    return FILE.format(file_id=file_id)


def file_data(file_id: str) -> str:
    return FILE_DATA.format(file_id=file_id)


def batch(batch_id: str) -> str:
    return BATCH.format(batch_id=batch_id)


def batch_pending(batch_id: str) -> str:
    return BATCH_PENDING.format(batch_id=batch_id)


def batch_lease(batch_id: str) -> str:
    return BATCH_LEASE.format(batch_id=batch_id)
