"""A worker's pulse, its name, and the reaper of dead workers' jobs (at-least-once delivery).

A live worker refreshes its RQ worker key every `heartbeat_s` with a TTL of `ttl_s`, from a
thread, so a long engine step never lets it lapse. When Redis has lost the record, or kept only
part of it (a FLUSHALL or a restart without persistence, after which a settle's counters make a
hash of a few fields), the heartbeat registers the worker again, whole, and the worker republishes
what `wicore status` and the gateway read of it. The thread outlives any Redis error.

A worker whose key has expired is dead (it was killed, or lost its host); any live worker's
reaper then returns that worker's claimed jobs to the heads of their queues (`RQBridge.requeue`),
so within about `ttl_s + reap_every_s` seconds every job a dead worker held is running elsewhere.

A worker restarted under the same name takes the dead one's record over at once when that record
names this host and a process that no longer runs, or is partial (Redis lost it); otherwise it
waits for the record to expire, and refuses to start if the record's heartbeat moves (a live
worker holds the name).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from redis import Redis
from redis.exceptions import RedisError

from wicore import keys, rq_keys
from wicore.errors import ConfigError
from wicore.worker.redis_link import is_outage
from wicore.worker.rq_bridge import RQBridge, RQWorkerRecord

log = logging.getLogger(__name__)

# KEYS: worker hash, worker executions index, RQ's set of worker keys. ARGV: ttl, now (RQ text).
# Refreshes RQ's heartbeat fields only while the record is whole: registered (in RQ's set) with
# the fields of its birth (RQ's own heartbeat would recreate an expired record as a hash with one
# field); returns 0 when it is gone or partial. The TTLs go first: Redis over its maxmemory takes
# EXPIRE, and once a script has written it runs to its end, so a memory blip never lets a live
# worker's record lapse.
_BEAT_LUA = """
if redis.call('HEXISTS', KEYS[1], 'birth') == 0 or redis.call('SISMEMBER', KEYS[3], KEYS[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[2])
return 1
"""


class Heartbeat(threading.Thread):
    def __init__(self, record: RQWorkerRecord, *, heartbeat_s: float, ttl_s: float):
        super().__init__(name="wicore-heartbeat", daemon=True)
        self.record = record
        self.heartbeat_s = heartbeat_s
        self.ttl = max(1, round(ttl_s))
        self._beat = record.connection.register_script(_BEAT_LUA)
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._registered_again = threading.Event()
        self._failing = False

    def beat(self) -> bool:
        """Refresh the record; False when it is gone or partial."""
        from rq.utils import now, utcformat

        record_keys = [self.record.key, self.record.executions_key, rq_keys.WORKERS]
        return bool(self._beat(keys=record_keys, args=[self.ttl, utcformat(now())]))

    def keep_registered(self) -> bool:
        """Refresh the record, registering again if it expired (a Redis outage longer than the
        TTL, or a stall) or is partial (Redis lost it); True if it had to. Either thread may call
        it."""
        with self._lock:
            if self.beat():
                return False
            self.record.register_again()
            self.beat()
        self._registered_again.set()
        log.warning("worker %s: its record had expired or was lost; registered again", self.record.name)
        return True

    def take_registered_again(self) -> bool:
        """True once after each registration `keep_registered` had to make."""
        if not self._registered_again.is_set():
            return False
        self._registered_again.clear()
        return True

    def run(self) -> None:
        while not self._stop_event.wait(self.heartbeat_s):
            try:
                self.keep_registered()
                self._failing = False
            except RedisError as exc:  # an outage the main loop rides out, or a bug: say so once
                if not self._failing:
                    log.warning("heartbeat failed: %s", exc if is_outage(exc) else repr(exc))
                self._failing = True
            except ValueError as exc:  # RQ: a record came back (another worker's, a settle's) before ours
                log.warning("heartbeat: %s", exc)

    def stop(self) -> None:
        self._stop_event.set()


def reap_dead_workers(connection: Redis, bridge: RQBridge) -> int:
    """Requeue the claims of every claimant whose worker key has expired. Safe to run from
    several workers at once: each claims set is handled in one atomic script, and not at all if
    its worker has registered again meanwhile."""
    handled = 0
    for raw in connection.smembers(keys.CLAIMANTS):
        name = raw.decode(errors="replace")
        if name == bridge.record.name or connection.exists(rq_keys.WORKER + name):
            continue
        count = bridge.requeue(keys.claims(name), died=True, owner=name)
        if count < 0:  # registered again between the two looks
            continue
        connection.srem(keys.CLAIMANTS, name)
        if count:
            log.warning("worker %s is gone; returned %d of its jobs to their queues", name, count)
        handled += count
    return handled


def take_over_name(record: RQWorkerRecord, wait_s: float) -> None:
    """Make way for `record`'s registration: drop a dead predecessor's record at once if it
    names this host and a process that is gone; else wait up to `wait_s` for it to expire."""
    connection = record.connection
    fields = connection.hmget(record.key, "hostname", "pid", "last_heartbeat", "death", "birth")
    if not connection.exists(record.key) or fields[3] is not None:  # none, or one that stopped cleanly
        return
    if fields[4] is None:  # no birth: what a settle left of a record Redis lost, no worker's
        connection.delete(record.key)
        return
    if _gone_from_this_host(fields[0], fields[1]):
        log.info("worker %s: taking over the record of its dead predecessor (pid %s)", record.name, fields[1])
        connection.delete(record.key)
        return
    log.warning("worker %s: waiting up to %.0fs for a previous worker of this name to expire", record.name, wait_s)
    deadline = time.monotonic() + wait_s
    while connection.exists(record.key) and time.monotonic() < deadline:
        time.sleep(0.25)
        if connection.hget(record.key, "last_heartbeat") not in (None, fields[2]):
            break
    if connection.exists(record.key):
        raise ConfigError(f"a live worker named {record.name} is running (its heartbeat moves): pick another --name")


def _gone_from_this_host(hostname: bytes | None, pid: bytes | None) -> bool:
    if hostname is None or hostname.decode(errors="replace") != socket.gethostname():
        return False
    try:
        number = int(pid or b"")
    except ValueError:
        return False
    if number == os.getpid():  # a restarted container reuses pids: that process was our predecessor
        return True
    try:
        os.kill(number, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    return False
