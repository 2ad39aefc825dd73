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

import logging
import secrets
import threading
import time

from redis import Redis
from redis.exceptions import RedisError

from wicore import keys
from wicore.errors import FileStoreUnavailable
from wicore.gateway.batch_driver import BatchDriver, BatchSettings
from wicore.gateway.batch_state import BatchRecords
from wicore.gateway.file_store import FileStore

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
REDIS_RETRY_S = 1.0  # the runner's pause after Redis or the file store failed it


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
            self.drivers[batch_id] = BatchDriver(batch_id, self.connection, self.store, self.settings, self.records)
        if not taken:
            self.drivers.pop(batch_id, None)
        return bool(taken)

    def release_all(self) -> None:
        for batch_id in list(self.drivers):
            self._release(keys=[keys.batch_lease(batch_id)], args=[self.owner])
        self.drivers.clear()
