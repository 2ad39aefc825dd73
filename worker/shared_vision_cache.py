"""The Redis-shared layer of the vision-embedding cache (implements the engines'
`EmbeddingStore`), so workers on several hosts skip the vision tower for images any of them
has seen.

Per namespace (the model id) and all under one hash tag, so one cluster slot holds them:
    wicore:vision:{<ns>}:e:<sha256>   the blob: `tensor_codec` format (JSON header + raw tensor bytes,
                                      checksummed; never pickle), expiring after `ttl_s` idle
    wicore:vision:{<ns>}:lru          sorted set, sha256 -> last use (unix ms)
    wicore:vision:{<ns>}:sizes        hash, sha256 -> blob bytes
    wicore:vision:{<ns>}:bytes        total blob bytes (what the cap counts; Redis' own
                                      per-key overhead comes on top)

Lookups are one round trip: a Lua script GETs every key and marks only the
hits used (ZADD XX, PEXPIRE: the TTL is an idle time). A pipelined MGET + ZADD XX would also
refresh the LRU time of members whose blob has already expired, keeping them out of the TTL
sweep. Writes are one Lua script: forget entries idle past the TTL, store the blobs, then drop
the least recently used until the total is under the cap. Last-use times come
from the clients' clocks; skew between hosts only blurs the LRU order and TTL bookkeeping.
A Redis failure is logged and counted as a miss, never raised to the job; after one, the layer
stays off for `cooldown_s` so a dead Redis does not add its timeouts to every batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import redis
import torch

from wicore.engines import tensor_codec as codec
from wicore.engines.kvcache.cache_stats import TierStats

log = logging.getLogger(__name__)
KEY_PREFIX = "wicore:vision"
EXPIRED_SCAN = 1000  # entries forgotten per write at most (the rest on later writes)

GET_SCRIPT = """
-- KEYS: lru, then one entry key per item; ARGV: now_ms, ttl_ms, then sha per item
local out = {}
for i = 2, #KEYS do
  local blob = redis.call('GET', KEYS[i])
  if blob then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i + 1])
  end
  out[i - 1] = blob
end
return out
"""

PUT_SCRIPT = """
-- KEYS: lru, sizes, total, then one entry key per item
-- ARGV: now_ms, ttl_ms, max_bytes, entry key prefix, expired scan limit, then sha, blob per item
local lru, sizes, total_key = KEYS[1], KEYS[2], KEYS[3]
local now, ttl, cap, prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local total = tonumber(redis.call('GET', total_key) or '0')
local function drop(sha)
  total = total - tonumber(redis.call('HGET', sizes, sha) or '0')
  redis.call('HDEL', sizes, sha)
  redis.call('ZREM', lru, sha)
  redis.call('DEL', prefix .. sha)
end
for _, sha in ipairs(redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[5]))) do
  drop(sha)
end
for i = 1, #KEYS - 3 do
  local sha, blob = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  total = total + #blob - tonumber(redis.call('HGET', sizes, sha) or '0')
  redis.call('SET', KEYS[3 + i], blob, 'PX', ttl)
  redis.call('HSET', sizes, sha, #blob)
  redis.call('ZADD', lru, now, sha)
end
local evicted = 0
while total > cap do
  local oldest = redis.call('ZRANGE', lru, 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
  evicted = evicted + 1
end
redis.call('SET', total_key, math.max(total, 0))
return evicted
"""


class RedisVisionCache:
    def __init__(
        self,
        connection: redis.Redis,
        namespace: str,
        max_bytes: int,
        ttl_s: float = 24 * 3600,
        cooldown_s: float = 30.0,
    ):
        if not namespace or any(c in namespace for c in "{}"):
            raise ValueError(f"namespace must be non-empty, without braces: {namespace!r}")
        if max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be positive")
        self.connection = connection
        self.max_bytes = max_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self.base = f"{KEY_PREFIX}:{{{namespace}}}"
        self.cooldown_s = cooldown_s
        self.stats = TierStats()
        # Lookups run on the engine's thread, writes on its write-behind one (`WriteBehind`):
        # counters change under this lock, never during a Redis call.
        self._stats_lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._get = connection.register_script(GET_SCRIPT)
        self._put = connection.register_script(PUT_SCRIPT)

    @property
    def lru_key(self) -> str:
        return f"{self.base}:lru"

    @property
    def sizes_key(self) -> str:
        return f"{self.base}:sizes"

    @property
    def total_key(self) -> str:
        return f"{self.base}:bytes"

    def entry_key(self, image_hash: str) -> str:
        return f"{self.base}:e:{image_hash}"

    def get_many(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        hashes = list(dict.fromkeys(hashes))
        if not hashes:
            return {}
        start = time.perf_counter()
        blobs = self._fetch(hashes)
        found = {h: t for h, blob in zip(hashes, blobs, strict=True) if (t := self._decode(h, blob)) is not None}
        corrupt = sum(blob is not None for blob in blobs) - len(found)
        self._count(
            seconds=time.perf_counter() - start,
            hits=len(found),
            misses=len(hashes) - len(found),
            bytes_out=sum(len(b) for b in blobs if b is not None),
            corrupt=corrupt,
        )
        return found

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None:
        blobs = {h: codec.encode(t) for h, t in items.items()}
        blobs = {h: b for h, b in blobs.items() if len(b) <= self.max_bytes}
        if not blobs or not self._available():
            return
        keys = [self.lru_key, self.sizes_key, self.total_key, *map(self.entry_key, blobs)]
        args: list[str | bytes | int] = [_now_ms(), self.ttl_ms, self.max_bytes, f"{self.base}:e:", EXPIRED_SCAN]
        for image_hash, blob in blobs.items():
            args += [image_hash, blob]
        start = time.perf_counter()
        try:
            evicted = int(self._put(keys=keys, args=args))
        except redis.RedisError as e:
            self._count(seconds=time.perf_counter() - start)
            self._failed("put", e)
            return
        self._count(seconds=time.perf_counter() - start, evictions=evicted, bytes_in=sum(map(len, blobs.values())))

    def _count(self, **added: float) -> None:
        with self._stats_lock:
            for name, value in added.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _fetch(self, hashes: list[str]) -> list[bytes | None]:
        """One round trip: the blobs, and a touch (LRU time, TTL) for those found."""
        if not self._available():
            return [None] * len(hashes)
        keys = [self.lru_key, *map(self.entry_key, hashes)]
        try:
            return self._get(keys=keys, args=[_now_ms(), self.ttl_ms, *hashes])
        except redis.RedisError as e:
            self._failed("lookup", e)
            return [None] * len(hashes)

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, error: redis.RedisError) -> None:
        log.warning("shared vision cache: %s failed, off for %.0f s: %s", what, self.cooldown_s, error)
        self._down_until = time.monotonic() + self.cooldown_s

    def _decode(self, image_hash: str, blob: bytes | None) -> torch.Tensor | None:
        if blob is None:
            return None
        try:
            return codec.decode(blob).tensor
        except codec.CorruptBlob as e:
            log.warning("shared vision cache: dropping damaged entry %s: %s", image_hash, e)
            return None


def _now_ms() -> int:
    return int(time.time() * 1000)
