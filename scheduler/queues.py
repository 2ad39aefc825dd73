"""The scheduler's Redis part: find a model's bucket queues and read their heads in one round
trip. RQ keeps every queue key in the set `rq:queues` and each job's enqueue time in its hash."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from redis import Redis

from wicore import rq_keys
from wicore.scheduler.buckets import BucketKey, queue_prefix
from wicore.scheduler.policy import QueueHead

RQ_QUEUE_KEY_PREFIX = rq_keys.QUEUE
RQ_QUEUES_SET = rq_keys.QUEUES

# KEYS: queue keys. Returns, per queue, its length and the enqueued_at of its head job (or false).
# Reads job hashes by computed key: fine on a single Redis, not on Redis Cluster.
_HEADS_LUA = (
    rq_keys.LUA_PREAMBLE
    + """
local out = {}
for _, key in ipairs(KEYS) do
  local n = redis.call('LLEN', key)
  local at = false
  if n > 0 then
    local id = redis.call('LINDEX', key, 0)
    at = redis.call('HGET', RQ.job .. id, 'enqueued_at')
  end
  out[#out + 1] = n
  out[#out + 1] = at
end
return out
"""
)


# The head age of a queue whose head job has no readable enqueue time (its hash was evicted or
# deleted, or holds garbage): the oldest possible, so the batch goes at once and the claim deals
# with that job, instead of a head that never ages and a partial batch that waits forever.
UNKNOWN_HEAD_TIME = 0.0


def parse_rq_time(raw: bytes | str | None, default: float) -> float:
    """RQ writes times as '%Y-%m-%dT%H:%M:%S.%fZ' (UTC)."""
    if not raw:
        return default
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return default


class BucketQueues:
    """The bucket queues of one model, rediscovered at most every `refresh_s` seconds (new
    buckets appear as producers enqueue new shapes)."""

    def __init__(self, connection: Redis, model: str, refresh_s: float = 1.0):
        self.connection = connection
        self.prefix = RQ_QUEUE_KEY_PREFIX + queue_prefix(model)
        self.refresh_s = refresh_s
        self._names: list[str] = []
        self._refreshed_at = float("-inf")
        self._read_heads = connection.register_script(_HEADS_LUA)

    def names(self) -> list[str]:
        if time.monotonic() - self._refreshed_at >= self.refresh_s:
            keys = (k.decode() for k in self.connection.smembers(RQ_QUEUES_SET))
            self._names = sorted(k[len(RQ_QUEUE_KEY_PREFIX) :] for k in keys if k.startswith(self.prefix))
            self._refreshed_at = time.monotonic()
        return self._names

    def heads(self) -> list[QueueHead]:
        names = self.names()
        if not names:
            return []
        flat = self._read_heads(keys=[RQ_QUEUE_KEY_PREFIX + n for n in names])
        heads = []
        for i, name in enumerate(names):
            bucket = BucketKey.parse(name)
            length = int(flat[2 * i])
            if bucket is not None and length:
                heads.append(QueueHead(bucket, length, parse_rq_time(flat[2 * i + 1], UNKNOWN_HEAD_TIME)))
        return heads
