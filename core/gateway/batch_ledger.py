"""A batch's committed progress: a gateway killed at any point leaves a batch that the next lease
holder resumes, cutting the files back to the committed bytes, with no line lost or written
twice."""

from __future__ import annotations

import json
from collections.abc import Iterator

from redis import Redis

from wicore import keys
from wicore.gateway.batch_state import BatchRecord, Fields, text
from wicore.gateway.file_store import FileStore, as_bytes


class BatchLedger:
    """What a batch's lease holder has committed: the bytes its output and error files hold, how
    far its input is read, its counts, and its lines waiting on jobs (a hash: job id ->
    [[number, custom_id, model]]). Lines go to the files first, then one transaction records
    what the files hold."""

    def __init__(self, connection: Redis, store: FileStore, batch_id: str):
        self.connection, self.store, self.batch_id = connection, store, batch_id
        self.pending_key = keys.batch_pending(batch_id)
        self.resumed = False
        self.out_file = self.err_file = ""
        self.out_bytes = self.err_bytes = 0

    def resume(self, record: BatchRecord) -> None:
        """Cut the output files back to what the last holder committed."""
        self.store.truncate(record.out_file, record.out_bytes)
        self.store.truncate(record.err_file, record.err_bytes)
        self.out_file, self.err_file = record.out_file, record.err_file
        self.out_bytes, self.err_bytes, self.resumed = record.out_bytes, record.err_bytes, True

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

    def pending_pages(self) -> Iterator[list[tuple[str, bytes]]]:
        for _, page in iter_hscan(self.connection, self.pending_key):
            yield page

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
