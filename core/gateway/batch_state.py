"""The records of files and batches in Redis: a hash per file (its FileObject's fields) and per
batch (its Batch object's fields and its progress), each indexed by creation time. Every field
read back is parsed defensively: a record someone else wrote reads as missing, never a 500."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from pydantic import ValidationError
from redis import Redis
from redis.typing import EncodableT

from wicore import keys
from wicore.gateway.batch_shapes import Batch, BatchError, BatchErrors, BatchStatus, FileObject, RequestCounts

LIST_LIMIT = 10_000  # most records one list call returns


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


Fields = dict[EncodableT, EncodableT]  # what HSET takes


def text(raw: object) -> str:
    """A Redis reply (bytes: no client here decodes responses) as text."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def text_fields(raw: dict) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


class FileRecords:
    def __init__(self, connection: Redis):
        self.connection = connection

    def save(self, record: FileObject) -> None:
        fields: Fields = {k: v for k, v in record.model_dump(mode="json").items() if v is not None}
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.hset(keys.file(record.id), mapping=fields)
            pipe.zadd(keys.FILES, {record.id: record.created_at})
            pipe.execute()

    def get(self, file_id: str) -> FileObject | None:
        raw = self.connection.hgetall(keys.file(file_id))
        try:
            return FileObject.model_validate(text_fields(raw)) if raw else None
        except ValidationError:
            return None

    def newest(self, limit: int, after: str | None, purpose: str | None) -> list[FileObject]:
        found = [f for f in map(self.get, ids_after(self.connection, keys.FILES, after)) if f is not None]
        return [f for f in found if purpose in (None, f.purpose)][:limit]

    def delete(self, file_id: str) -> None:
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file(file_id))
            pipe.zrem(keys.FILES, file_id)
            pipe.execute()


def ids_after(connection: Redis, index: str, after: str | None) -> list[str]:
    """Ids of `index` newest first, those after the id `after` (a list's cursor)."""
    ids = [text(raw) for raw in connection.zrevrange(index, 0, LIST_LIMIT - 1)]
    return ids[ids.index(after) + 1 :] if after in ids else ids


@dataclass
class BatchRecord:
    """A batch's hash: the Batch object's own fields, and where its run stands."""

    batch: Batch
    out_file: str  # the output file's id, named at creation, listed once the batch ends
    err_file: str
    offset: int = 0  # bytes of the input file turned into jobs or error lines
    lines: int = 0  # non-blank lines read so far
    out_bytes: int = 0  # what the output file holds, committed (a restart cuts it back to this)
    err_bytes: int = 0
    ending: str = ""  # 'expired' or 'cancelled' while the batch is being ended that way

    @classmethod
    def parse(cls, raw: dict) -> BatchRecord | None:
        fields = text_fields(raw)
        try:
            batch = Batch.model_validate_json(fields["batch"])
            counts = RequestCounts(**{k: int(fields.get(k, 0)) for k in ("total", "completed", "failed")})
            batch = batch.model_copy(update={"request_counts": counts, **timestamps(fields)})
            return cls(
                batch=batch,
                out_file=fields["out_file"],
                err_file=fields["err_file"],
                **{k: int(fields.get(k, 0)) for k in ("offset", "lines", "out_bytes", "err_bytes")},
                ending=fields.get("ending", ""),
            )
        except (KeyError, ValueError):  # ValidationError is a ValueError
            return None


STATE_FIELDS = ("status", "output_file_id", "error_file_id", "errors")
TIME_FIELDS = tuple(f for f in Batch.model_fields if f.endswith("_at") and f not in ("created_at", "expires_at"))


def timestamps(fields: dict[str, str]) -> dict:
    """The fields that change as the batch runs, from their own hash fields."""
    found: dict = {name: int(float(fields[name])) for name in TIME_FIELDS if name in fields}
    found.update({name: fields[name] for name in ("output_file_id", "error_file_id") if name in fields})
    if "status" in fields:
        found["status"] = BatchStatus(fields["status"])
    if "errors" in fields:
        found["errors"] = BatchErrors.model_validate_json(fields["errors"])
    return found


class BatchRecords:
    def __init__(self, connection: Redis):
        self.connection = connection

    def create(self, batch: Batch, store: str) -> None:
        fields: Fields = {
            "store": store,
            "batch": batch.model_dump_json(),
            "status": batch.status.value,
            "out_file": new_id("file"),
            "err_file": new_id("file"),
        }
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch.id), mapping=fields)
            pipe.zadd(keys.BATCHES, {batch.id: batch.created_at})
            pipe.sadd(keys.BATCHES_ACTIVE, batch.id)
            pipe.execute()

    def get(self, batch_id: str) -> BatchRecord | None:
        raw = self.connection.hgetall(keys.batch(batch_id))
        return BatchRecord.parse(raw) if raw else None

    def newest(self, limit: int, after: str | None) -> list[Batch]:
        found = (self.get(batch_id) for batch_id in ids_after(self.connection, keys.BATCHES, after))
        return [record.batch for record in found if record is not None][:limit]

    def active(self, store: str) -> list[str]:
        """Unfinished batches whose files are in `store`."""
        ids = [text(raw) for raw in self.connection.smembers(keys.BATCHES_ACTIVE)]
        with self.connection.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hget(keys.batch(batch_id), "store")
            stores = pipe.execute()
        return [batch_id for batch_id, found in zip(ids, stores) if found in (None, store.encode())]

    def set_status(self, batch_id: str, status: BatchStatus, pipe=None, **fields: str) -> None:
        """The new status, stamped `<status>_at` now (OpenAI's field names)."""
        target = pipe if pipe is not None else self.connection
        mapping: Fields = {"status": status.value, f"{status.value}_at": int(time.time())}
        mapping.update(fields)
        target.hset(keys.batch(batch_id), mapping=mapping)

    def request_cancel(self, batch_id: str) -> None:
        self.set_status(batch_id, BatchStatus.CANCELLING)


def errors_json(code: str, message: str, param: str | None = None) -> str:
    return BatchErrors(data=[BatchError(code=code, message=message, param=param)]).model_dump_json()
