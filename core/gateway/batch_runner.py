"""What moves batches along: every gateway runs one `BatchRunner` thread, which takes a lease
on each unfinished batch it finds (a Redis key with a TTL, renewed while it works) and drives the
batches it holds: validate the input file, turn its lines into bulk-lane jobs chunk by chunk,
collect the jobs that ended into the output and error files, and end the batch.

Everything a run needs lives in Redis or the file store, and every step commits its progress in
one transaction with what it wrote (the input offset, the bytes the output files hold, the lines
still waiting on jobs): a gateway killed at any point leaves a batch that the next lease holder
resumes, cutting the files back to the committed bytes, with no line lost or written twice.
Jobs are deduplicated by the producer, so lines submitted again after a restart run nothing new.
A batch's jobs notify a list of its own (`keys.notify("batch-<id>")`); a sweep of its waiting
jobs' statuses every `sweep_s` catches what no notification reports (a job shared with another
submitter, one that ended before the restart)."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import RedisError

from wicore import keys
from wicore.errors import FileStoreUnavailable, WicoreError
from wicore.gateway.batch_lines import (
    CANCELLED,
    EXPIRED,
    InputLine,
    custom_id_in,
    ended_line,
    not_run_line,
    read_line,
    refused_line,
)
from wicore.gateway.batch_shapes import BatchStatus, FileObject
from wicore.gateway.batch_state import BatchRecord, BatchRecords, Fields, FileRecords, errors_json, text
from wicore.gateway.errors import ApiError
from wicore.gateway.file_store import FileStore, as_bytes, lines_from
from wicore.gateway.submissions import problem
from wicore.gateway.workers import live_models
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.producer.waiting import ENDED, MISSING

log = logging.getLogger(__name__)

# KEYS[1]: the lease; ARGV: owner, TTL in ms. 2: taken now, 1: renewed, 0: another owner holds it.
_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 2 end
return 0
"""
_RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
MODELS_TTL_S = 2.0  # a read of the live workers' models is reused this long
REDIS_RETRY_S = 1.0  # the runner's pause after Redis or the file store failed it


@dataclass(frozen=True)
class BatchSettings:
    default_model: str  # lines for it are taken even with no live worker (as the gateway's routes do)
    allowed_roots: tuple[Path, ...] = ()
    producer: ProducerConfig = field(default_factory=lambda: ProducerConfig(by_path=True))
    window_s: float = 86_400.0  # how long the "24h" completion window lasts
    chunk_lines: int = 1024  # lines per submission round trip
    lease_s: float = 15.0  # a dead gateway's batches move to another after this
    sweep_s: float = 5.0
    idle_s: float = 0.2  # the runner's pause when no batch had work
    slice_s: float = 0.5  # one batch's turn before the next batch's


def batch_session(batch_id: str) -> str:
    return f"batch-{batch_id}"


class BatchRunner:
    """Drives every unfinished batch whose lease this process holds (`run` in a thread)."""

    def __init__(self, connection: Redis, store: FileStore, settings: BatchSettings):
        self.connection, self.store, self.settings = connection, store, settings
        self.owner = secrets.token_hex(8)
        self.records = BatchRecords(connection)
        self.drivers: dict[str, BatchDriver] = {}
        self._lease = connection.register_script(_LEASE_LUA)
        self._release = connection.register_script(_RELEASE_LUA)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                busy = self.turn()
            except (RedisError, FileStoreUnavailable) as exc:  # batches wait in Redis, the runner retries
                log.warning("batch runner: %s; retrying in %g s", exc, REDIS_RETRY_S)
                stop.wait(REDIS_RETRY_S)
                continue
            if not busy:
                stop.wait(self.settings.idle_s)
        self.release_all()

    def turn(self) -> bool:
        """One step of each batch this process holds; True if any had work."""
        busy = False
        for batch_id in self.records.active(self.store.name):
            if self.hold(batch_id):
                busy |= self.step(batch_id)
        return busy

    def step(self, batch_id: str) -> bool:
        """The batch's next step; a batch whose step fails for another reason than Redis (its
        files unreadable, a bug) ends `failed` with the reason, and the others go on. When the
        file store fails, the batch's driver goes: the next one resumes from what was committed."""
        try:
            return self.drivers[batch_id].advance()
        except RedisError:
            raise
        except FileStoreUnavailable:
            self.drivers.pop(batch_id, None)
            raise
        except Exception as exc:  # noqa: BLE001 (one batch's failure must not stop every batch)
            log.exception("batch %s failed", batch_id)
            return self.drivers[batch_id].fail("internal_error", f"{type(exc).__name__}: {exc}")

    def run_until_ended(self, batch_id: str) -> None:
        """Drive the batches until `batch_id` has ended (`wicore run-batch`)."""
        while (record := self.records.get(batch_id)) is not None and not record.batch.status.ended:
            if not self.turn():
                time.sleep(self.settings.idle_s)
        self.release_all()

    def hold(self, batch_id: str) -> bool:
        taken = self._lease(keys=[keys.batch_lease(batch_id)], args=[self.owner, int(self.settings.lease_s * 1000)])
        if taken == 2 or (taken == 1 and batch_id not in self.drivers):  # new to this process: resume
            self.drivers[batch_id] = BatchDriver(batch_id, self)
        if not taken:
            self.drivers.pop(batch_id, None)
        return bool(taken)

    def release_all(self) -> None:
        for batch_id in list(self.drivers):
            self._release(keys=[keys.batch_lease(batch_id)], args=[self.owner])
        self.drivers.clear()


class BatchDriver:
    """One batch's state machine, as its lease holder runs it."""

    def __init__(self, batch_id: str, runner: BatchRunner):
        self.batch_id, self.runner = batch_id, runner
        self.connection, self.store, self.settings = runner.connection, runner.store, runner.settings
        self.records = runner.records
        self.pending_key = keys.batch_pending(batch_id)
        self.notify_key = keys.notify(batch_session(batch_id))
        self.producers: dict[str, Producer] = {}
        self.models: tuple[float, dict[str, int]] = (float("-inf"), {})
        self.next_sweep = 0.0  # sweep at once: a new holder catches what ended before it came
        self.resumed = False
        self.out_file = self.err_file = ""
        self.out_bytes = self.err_bytes = 0

    # -- the state machine -------------------------------------------------------------------

    def advance(self) -> bool:
        record = self.records.get(self.batch_id)
        if record is None or record.batch.status.ended:
            self.connection.srem(keys.BATCHES_ACTIVE, self.batch_id)
            return False
        if not self.resumed:
            self.resume(record)
        status = record.batch.status
        if status == BatchStatus.VALIDATING:
            return self.validate(record)
        if record.ending == "expired" or time.time() >= (record.batch.expires_at or float("inf")):
            return self.end(record, BatchStatus.EXPIRED)
        if status == BatchStatus.CANCELLING:
            return self.cancel(record)
        return self.progress(record)

    def resume(self, record: BatchRecord) -> None:
        """Cut the output files back to what the last holder committed."""
        self.store.truncate(record.out_file, record.out_bytes)
        self.store.truncate(record.err_file, record.err_bytes)
        self.out_file, self.err_file = record.out_file, record.err_file
        self.out_bytes, self.err_bytes, self.resumed = record.out_bytes, record.err_bytes, True

    def validate(self, record: BatchRecord) -> bool:
        if FileRecords(self.connection).get(record.batch.input_file_id) is None:
            return self.fail("file_not_found", f"input file {record.batch.input_file_id} no longer exists")
        total = self.count_lines(record)
        if not total:
            return self.fail("empty_file", "the input file has no lines")
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(self.batch_id), "total", total)
            self.records.set_status(self.batch_id, BatchStatus.IN_PROGRESS, pipe)
            pipe.execute()
        return True

    def count_lines(self, record: BatchRecord) -> int:
        """The input's non-blank lines, read once through."""
        return sum(1 for _, raw in lines_from(self.store, record.batch.input_file_id, 0) if raw.strip())

    def fail(self, code: str, message: str) -> bool:
        with self.connection.pipeline(transaction=True) as pipe:
            self.records.set_status(self.batch_id, BatchStatus.FAILED, pipe, errors=errors_json(code, message))
            pipe.srem(keys.BATCHES_ACTIVE, self.batch_id)
            pipe.execute()
        return True

    def progress(self, record: BatchRecord) -> bool:
        busy = self.submit(record) | self.collect()
        if self.all_read(record) and not self.connection.hlen(self.pending_key):
            self.records.set_status(self.batch_id, BatchStatus.FINALIZING)
            self.finish(record, BatchStatus.COMPLETED)
            return True
        return busy

    def cancel(self, record: BatchRecord) -> bool:
        """Queued jobs this batch enqueued are canceled (their lines: batch_cancelled); running
        ones finish and keep their answers; then the lines never submitted are written off."""
        if not record.batch.request_counts.total:  # cancelled while validating
            self.connection.hset(keys.batch(self.batch_id), "total", self.count_lines(record))
        for page in self.pending_pages():
            self.producer(None).cancel([job_id for job_id, _ in page], own_queued_only=True)
        self.collect()
        if self.connection.hlen(self.pending_key):
            return True
        self.write_off(record, CANCELLED)
        self.finish(record, BatchStatus.CANCELLED)
        return True

    def end(self, record: BatchRecord, status: BatchStatus) -> bool:
        """The window has passed: what ended is kept, everything else is written off."""
        self.connection.hset(keys.batch(self.batch_id), "ending", "expired")
        for page in self.pending_pages():
            self.producer(None).cancel([job_id for job_id, _ in page], own_queued_only=True)
        self.next_sweep = 0.0
        self.collect(EXPIRED)
        for page in self.pending_pages():
            self.write_off_waiting(page, EXPIRED)
        self.write_off(record, EXPIRED)
        self.finish(record, status)
        return True

    def finish(self, record: BatchRecord, status: BatchStatus) -> None:
        """List the output files that hold lines, and end the batch."""
        files = FileRecords(self.connection)
        ids = {}
        for name, file_id, size in (
            ("output", record.out_file, self.out_bytes),
            ("error", record.err_file, self.err_bytes),
        ):
            if size:
                files.save(batch_output(file_id, f"{self.batch_id}_{name}.jsonl", size))
                ids[f"{name}_file_id"] = file_id
        with self.connection.pipeline(transaction=True) as pipe:
            self.records.set_status(self.batch_id, status, pipe, **ids)
            pipe.srem(keys.BATCHES_ACTIVE, self.batch_id)
            pipe.delete(self.pending_key, self.notify_key)
            pipe.execute()

    # -- lines into jobs ---------------------------------------------------------------------

    def all_read(self, record: BatchRecord) -> bool:
        fresh = self.records.get(self.batch_id) or record
        return fresh.lines >= fresh.batch.request_counts.total

    def submit(self, record: BatchRecord) -> bool:
        """Chunks of lines into jobs until the batch's time slice is spent or the file ends."""
        stop_at = time.monotonic() + self.settings.slice_s
        offset, number, busy = record.offset, record.lines, False
        lines = self.unread(record.batch.input_file_id, offset)
        while time.monotonic() < stop_at and (chunk := list(islice(lines, self.settings.chunk_lines))):
            offset, number = self.submit_chunk(chunk, number)
            busy = True
        return busy

    def unread(self, file_id: str, offset: int) -> Iterator[tuple[int, bytes]]:
        """(offset past the line, the line) for each line after `offset`, blank ones included."""
        return lines_from(self.store, file_id, offset)

    def submit_chunk(self, chunk: list[tuple[int, bytes]], number: int) -> tuple[int, int]:
        roots = self.settings.allowed_roots
        lines = []
        for _, raw in chunk:
            if raw.strip():
                number += 1
                lines.append(read_line(number, raw, roots))
        waiting = self.enqueue([line for line in lines if line.error is None])
        refused = [line for line in lines if line.error is not None]
        errors = b"".join(refused_line(self.batch_id, line) for line in refused)
        self.commit(err=errors, failed=len(refused), waiting=self.merged(waiting), offset=chunk[-1][0], lines=number)
        return chunk[-1][0], number

    def enqueue(self, lines: list[InputLine]) -> dict[str, list[list]]:
        """Each good line's job, one pipeline per model: job id -> [[number, custom_id, model]]."""
        by_model: dict[str, list] = defaultdict(list)
        for line in lines:
            try:
                producer = self.producer(line.model)
                by_model[producer.model].append((line, producer.prepare(submission_of(line))))
            except (ValidationError, WicoreError, ApiError) as exc:
                line.error = problem(exc)
        waiting: dict[str, list[list]] = defaultdict(list)
        for model, items in by_model.items():
            ids = self.producer(model).enqueue_prepared([prepared for _, prepared in items])
            for (line, _), job_id in zip(items, ids):
                waiting[job_id].append([line.number, line.custom_id, model])
        return waiting

    def merged(self, waiting: dict[str, list[list]]) -> Fields:
        """The chunk's waiting lines added to those already waiting on the same jobs; a line
        read again after a restart is there once."""
        if not waiting:
            return {}
        ids = list(waiting)
        merged: Fields = {}
        for job_id, raw in zip(ids, self.connection.hmget(self.pending_key, ids)):
            entries = parse_entries(raw)
            known = {entry[0] for entry in entries}
            entries += [entry for entry in waiting[job_id] if entry[0] not in known]
            merged[job_id] = json.dumps(entries)
        return merged

    def producer(self, model: str | None) -> Producer:
        name = model or self.settings.default_model
        if name != self.settings.default_model and name not in self.live_models():
            raise ApiError(400, f"model: {name!r} is not served by any live worker", param="model")
        if name not in self.producers:
            config = replace(self.settings.producer, notify=True)
            self.producers[name] = Producer(
                self.connection, model=name, config=config, session=batch_session(self.batch_id)
            )
        return self.producers[name]

    def live_models(self) -> dict[str, int]:
        read_at, models = self.models
        if time.monotonic() - read_at > MODELS_TTL_S:
            self.models = (time.monotonic(), live_models([self.connection]))
        return self.models[1]

    # -- jobs into output lines ---------------------------------------------------------------

    def collect(self, canceled_as: tuple[str, str] = CANCELLED) -> bool:
        """Write the lines of every job that ended (notified, or found by the sweep)."""
        ended = {text(raw) for raw in as_list(self.connection.lpop(self.notify_key, 4096))}
        if time.monotonic() >= self.next_sweep:
            ended |= self.sweep()
            self.next_sweep = time.monotonic() + self.settings.sweep_s
        if not ended:
            return False
        ids = list(ended)
        outcomes = {o.job_id: o for o in self.producer(None).outcomes(ids) if o.done or o.status == MISSING}
        found = [(job_id, raw) for job_id, raw in zip(ids, self.connection.hmget(self.pending_key, ids)) if raw]
        out: list[bytes] = []
        err: list[bytes] = []
        completed, failed, done = 0, 0, []
        for job_id, raw in found:
            if job_id not in outcomes:
                continue
            done.append(job_id)
            for number, custom_id, model in parse_entries(raw):
                answered, line = ended_line(self.batch_id, number, custom_id, model, outcomes[job_id], canceled_as)
                (out if answered else err).append(line)
                completed, failed = completed + answered, failed + (not answered)
        self.commit(out=b"".join(out), err=b"".join(err), completed=completed, failed=failed, done=done)
        return bool(done)

    def sweep(self) -> set[str]:
        """Waiting jobs that have ended, by their status."""
        ended = set()
        for page in self.pending_pages():
            ids = [job_id for job_id, _ in page]
            with self.connection.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(f"rq:job:{job_id}", "status")
                statuses = pipe.execute()
            ended |= {job_id for job_id, s in zip(ids, statuses) if s is None or text(s) in ENDED}
        return ended

    def pending_pages(self) -> Iterator[list[tuple[str, bytes]]]:
        for _, page in iter_hscan(self.connection, self.pending_key):
            yield page

    def write_off_waiting(self, page: list[tuple[str, bytes]], reason: tuple[str, str]) -> None:
        lines = [not_run_line(self.batch_id, n, cid, reason) for _, raw in page for n, cid, _ in parse_entries(raw)]
        self.commit(err=b"".join(lines), failed=len(lines), done=[job_id for job_id, _ in page])

    def write_off(self, record: BatchRecord, reason: tuple[str, str]) -> None:
        """Every line not yet submitted, as an error line saying why it never ran."""
        fresh = self.records.get(self.batch_id) or record
        number, lines = fresh.lines, self.unread(fresh.batch.input_file_id, fresh.offset)
        while chunk := list(islice(lines, self.settings.chunk_lines)):
            written = []
            for _, raw in chunk:
                if raw.strip():
                    number += 1
                    written.append(not_run_line(self.batch_id, number, custom_id_in(raw), reason))
            self.commit(err=b"".join(written), failed=len(written), offset=chunk[-1][0], lines=number)

    # -- committing --------------------------------------------------------------------------

    def commit(
        self,
        *,
        out: bytes = b"",
        err: bytes = b"",
        completed: int = 0,
        failed: int = 0,
        waiting: Fields | None = None,
        done: list[str] | None = None,
        offset: int | None = None,
        lines: int | None = None,
    ) -> None:
        """Append the lines to the files, then record in one transaction what they hold, the
        counts, the lines now waiting and those no longer waiting, and how far the input is read."""
        if out:
            self.out_bytes = self.store.append(self.out_file, out)
        if err:
            self.err_bytes = self.store.append(self.err_file, err)
        progress: Fields = {"out_bytes": self.out_bytes, "err_bytes": self.err_bytes}
        if offset is not None and lines is not None:
            progress.update(offset=offset, lines=lines)
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(self.batch_id), mapping=progress)
            for name, count in (("completed", completed), ("failed", failed)):
                if count:
                    pipe.hincrby(keys.batch(self.batch_id), name, count)
            if waiting:
                pipe.hset(self.pending_key, mapping=waiting)
            if done:
                pipe.hdel(self.pending_key, *done)
            pipe.execute()


def submission_of(line: InputLine) -> Submission:
    if line.submission is None:
        raise ApiError(400, line.error or "the line has no request")
    return line.submission


def parse_entries(raw: object) -> list[list]:
    """[[number, custom_id, model], ...] from a waiting-lines field; [] for one we cannot read."""
    try:
        entries = json.loads(raw) if isinstance(raw, bytes | str) and raw else []
    except ValueError:
        return []
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, list) and len(e) == 3 and isinstance(e[0], int)]


def iter_hscan(connection: Redis, key: str, count: int = 1000) -> Iterator[tuple[int, list[tuple[str, bytes]]]]:
    """Pages of a hash's (field, value) pairs."""
    cursor = None
    while cursor != 0:
        cursor, fields = connection.hscan(key, cursor or 0, count=count)
        if isinstance(fields, dict) and fields:
            yield cursor, [(text(k), as_bytes(v)) for k, v in fields.items()]


def as_list(raw: object) -> list:
    """LPOP with a count: a list, or None when the list is empty."""
    return raw if isinstance(raw, list) else []


def batch_output(file_id: str, filename: str, size: int) -> FileObject:
    return FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose="batch_output")
