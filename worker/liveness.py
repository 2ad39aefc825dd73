"""A worker's pulse and the reaper of dead workers' jobs (at-least-once delivery).

A live worker refreshes its RQ worker key every `heartbeat_s` with a TTL of `ttl_s`, from a
thread, so a long engine step never lets it lapse. A worker whose key has expired is dead (it
was killed, or lost its host); any live worker's reaper then returns that worker's claimed jobs
to their queues (`RQBridge.requeue_claims`), so within about `ttl_s + reap_every_s` seconds
every job a dead worker held is running elsewhere.
"""

from __future__ import annotations

import logging
import threading
import uuid

from redis import Redis
from redis.exceptions import ResponseError

from wicore import keys
from wicore.worker.rq_bridge import RQBridge, RQWorkerRecord

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    def __init__(self, record: RQWorkerRecord, *, heartbeat_s: float, ttl_s: float):
        super().__init__(name="wicore-heartbeat", daemon=True)
        self.record = record
        self.heartbeat_s = heartbeat_s
        self.ttl = max(1, round(ttl_s))
        self._stop_event = threading.Event()

    def beat(self) -> None:
        self.record.heartbeat(timeout=self.ttl)

    def run(self) -> None:
        while not self._stop_event.wait(self.heartbeat_s):
            try:
                self.beat()
            except Exception as exc:  # a Redis hiccup must not end the pulse; the next beat retries
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop_event.set()


def reap_dead_workers(connection: Redis, bridge: RQBridge) -> int:
    """Requeue the claims of every claimant whose worker key has expired. Safe to run from
    several workers at once: a claims list is renamed away atomically before it is handled."""
    handled = 0
    for raw in connection.smembers(keys.CLAIMANTS):
        name = raw.decode()
        if name == bridge.record.name or connection.exists(f"rq:worker:{name}"):
            continue
        reaping = f"{keys.claims(name)}:reaping:{uuid.uuid4().hex}"
        try:
            connection.rename(keys.claims(name), reaping)
        except ResponseError:  # no such key: nothing claimed, or another reaper got there first
            connection.srem(keys.CLAIMANTS, name)
            continue
        count = bridge.requeue_claims(reaping)
        connection.srem(keys.CLAIMANTS, name)
        log.warning("worker %s is gone; returned %d of its jobs to their queues", name, count)
        handled += count
    return handled
