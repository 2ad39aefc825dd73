"""One batch's state machine, as its lease holder runs it (`batch_runner`): validate the input
file, turn its lines into bulk-lane jobs chunk by chunk, collect the jobs that ended into the
output and error files (`batch_ledger` commits them), and end the batch."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

from pydantic import ValidationError
from redis import Redis

from wicore import keys
from wicore.errors import WicoreError
from wicore.gateway.batch_ledger import BatchLedger, parse_entries
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
from wicore.gateway.batch_state import BatchRecord, BatchRecords, FileRecords, errors_json, text
from wicore.gateway.errors import ApiError
from wicore.gateway.file_store import FileStore, lines_from
from wicore.gateway.submissions import problem
from wicore.gateway.workers import live_models
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.producer.waiting import ENDED, MISSING

MODELS_TTL_S = 2.0  # a read of the live workers' models is reused this long


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


class BatchDriver:
    """One batch's state machine, as its lease holder runs it."""

    def __init__(
        self, batch_id: str, connection: Redis, store: FileStore, settings: BatchSettings, records: BatchRecords
    ):
        self.batch_id, self.connection, self.store, self.settings = batch_id, connection, store, settings
        self.records = records
        self.ledger = BatchLedger(connection, store, batch_id)
        self.pending_key = self.ledger.pending_key
        self.notify_key = keys.notify(batch_session(batch_id))
        self.producers: dict[str, Producer] = {}
        self.models: tuple[float, dict[str, int]] = (float("-inf"), {})
        self.next_sweep = 0.0  # sweep at once: a new holder catches what ended before it came

    # -- the state machine -------------------------------------------------------------------

    def advance(self) -> bool:
        record = self.records.get(self.batch_id)
        if record is None or record.batch.status.ended:
            self.connection.srem(keys.BATCHES_ACTIVE, self.batch_id)
            return False
        if not self.ledger.resumed:
            self.ledger.resume(record)
        status = record.batch.status
        if status == BatchStatus.VALIDATING:
            return self.validate(record)
        if record.ending == "expired" or time.time() >= (record.batch.expires_at or float("inf")):
            return self.end(record, BatchStatus.EXPIRED)
        if status == BatchStatus.CANCELLING:
            return self.cancel(record)
        return self.progress(record)

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
        for page in self.ledger.pending_pages():
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
        for page in self.ledger.pending_pages():
            self.producer(None).cancel([job_id for job_id, _ in page], own_queued_only=True)
        self.next_sweep = 0.0
        self.collect(EXPIRED)
        for page in self.ledger.pending_pages():
            self.write_off_waiting(page, EXPIRED)
        self.write_off(record, EXPIRED)
        self.finish(record, status)
        return True

    def finish(self, record: BatchRecord, status: BatchStatus) -> None:
        """List the output files that hold lines, and end the batch."""
        files = FileRecords(self.connection)
        ids = {}
        for name, file_id, size in (
            ("output", record.out_file, self.ledger.out_bytes),
            ("error", record.err_file, self.ledger.err_bytes),
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
        self.ledger.commit(
            err=errors, failed=len(refused), waiting=self.ledger.merged(waiting), offset=chunk[-1][0], lines=number
        )
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
        self.ledger.commit(out=b"".join(out), err=b"".join(err), completed=completed, failed=failed, done=done)
        return bool(done)

    def sweep(self) -> set[str]:
        """Waiting jobs that have ended, by their status."""
        ended = set()
        for page in self.ledger.pending_pages():
            ids = [job_id for job_id, _ in page]
            with self.connection.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(f"rq:job:{job_id}", "status")
                statuses = pipe.execute()
            ended |= {job_id for job_id, s in zip(ids, statuses) if s is None or text(s) in ENDED}
        return ended

    def write_off_waiting(self, page: list[tuple[str, bytes]], reason: tuple[str, str]) -> None:
        lines = [not_run_line(self.batch_id, n, cid, reason) for _, raw in page for n, cid, _ in parse_entries(raw)]
        self.ledger.commit(err=b"".join(lines), failed=len(lines), done=[job_id for job_id, _ in page])

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
            self.ledger.commit(err=b"".join(written), failed=len(written), offset=chunk[-1][0], lines=number)


def submission_of(line: InputLine) -> Submission:
    if line.submission is None:
        raise ApiError(400, line.error or "the line has no request")
    return line.submission


def as_list(raw: object) -> list:
    """LPOP with a count: a list, or None when the list is empty."""
    return raw if isinstance(raw, list) else []


def batch_output(file_id: str, filename: str, size: int) -> FileObject:
    return FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose="batch_output")
