import pickle
import time
from pathlib import Path

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from wicore.embedded import free_port
from wicore.engines import tensor_codec as codec
from wicore.engines.vision_cache import EmbeddingStore, LocalVisionCache, VisionCache
from wicore.worker import shared_vision_cache as module
from wicore.worker.shared_vision_cache import RedisVisionCache


def emb(i, dtype=torch.bfloat16):
    return torch.full((16, 32), float(i)).to(dtype)  # 1 KiB in bf16


def h(i):
    return f"{i:064x}"


BLOB = len(codec.encode(emb(0)))


def test_round_trip_is_exact(redis_conn):
    cache: EmbeddingStore = RedisVisionCache(redis_conn, "tiny", max_bytes=10**6)
    items = {h(0): torch.randn(16, 32).bfloat16(), h(1): torch.randn(4, 8)}
    cache.put_many(items)
    found = cache.get_many([h(1), h(0), h(2)])
    assert sorted(found) == [h(0), h(1)]
    for key, tensor in items.items():
        assert found[key].dtype == tensor.dtype and torch.equal(found[key], tensor)
    assert (cache.stats.hits, cache.stats.misses) == (2, 1)


def test_ttl_is_set_and_refreshed_by_a_hit(redis_conn):
    cache = RedisVisionCache(redis_conn, "tiny", max_bytes=10**6, ttl_s=60)
    cache.put_many({h(0): emb(0)})
    key = cache.entry_key(h(0))
    assert 55_000 < redis_conn.pttl(key) <= 60_000
    redis_conn.pexpire(key, 30_000)  # well short of the 60 s a hit sets, and no stall lets it lapse first
    cache.get_many([h(0)])
    assert redis_conn.pttl(key) > 55_000


def test_cap_is_enforced_oldest_out(redis_conn):
    cache = RedisVisionCache(redis_conn, "tiny", max_bytes=3 * BLOB)
    for i in range(3):
        cache.put_many({h(i): emb(i)})
        time.sleep(0.002)  # distinct last-use times
    cache.get_many([h(0)])  # 0 used last: 1 is the oldest now
    time.sleep(0.002)
    cache.put_many({h(3): emb(3), h(4): emb(4)})
    assert set(cache.get_many([h(i) for i in range(5)])) == {h(0), h(3), h(4)}
    assert int(redis_conn.get(cache.total_key)) == 3 * BLOB
    assert redis_conn.zcard(cache.lru_key) == redis_conn.hlen(cache.sizes_key) == 3
    assert cache.stats.evictions == 2


def test_entries_idle_past_the_ttl_leave_the_accounting(redis_conn):
    cache = RedisVisionCache(redis_conn, "tiny", max_bytes=10**6, ttl_s=0.05)
    cache.put_many({h(0): emb(0)})
    time.sleep(0.1)
    assert cache.get_many([h(0)]) == {}
    cache.put_many({h(1): emb(1)})
    assert int(redis_conn.get(cache.total_key)) == BLOB
    assert redis_conn.zrange(cache.lru_key, 0, -1) == [h(1).encode()]


def test_too_big_entries_are_skipped(redis_conn):
    cache = RedisVisionCache(redis_conn, "tiny", max_bytes=BLOB - 1)
    cache.put_many({h(0): emb(0)})
    assert redis_conn.dbsize() == 0


def test_lookup_is_one_round_trip(redis_url):
    class Counting(redis.Redis):
        commands = pipelines = 0

        def execute_command(self, *args, **options):
            self.commands += 1
            return super().execute_command(*args, **options)

        def pipeline(self, *args, **kwargs):
            self.pipelines += 1
            return super().pipeline(*args, **kwargs)

    connection = Counting.from_url(redis_url)
    cache = RedisVisionCache(connection, "tiny", max_bytes=10**6)
    cache.put_many({h(i): emb(i) for i in range(8)})
    connection.commands = connection.pipelines = 0
    assert len(cache.get_many([h(i) for i in range(16)])) == 8
    assert (connection.commands, connection.pipelines) == (1, 0)  # one EVALSHA


def test_no_pickle(redis_conn):
    cache = RedisVisionCache(redis_conn, "tiny", max_bytes=10**6)
    cache.put_many({h(0): emb(0)})
    assert redis_conn.get(cache.entry_key(h(0))).startswith(codec.MAGIC)
    assert "import pickle" not in Path(module.__file__).read_text()
    redis_conn.set(cache.entry_key(h(1)), pickle.dumps(emb(1)))  # never unpickled
    assert list(cache.get_many([h(0), h(1)])) == [h(0)] and cache.stats.corrupt == 1


def test_namespaces_are_separate(redis_conn):
    a = RedisVisionCache(redis_conn, "model-a", max_bytes=10**6)
    b = RedisVisionCache(redis_conn, "model-b", max_bytes=10**6)
    a.put_many({h(0): emb(0)})
    assert b.get_many([h(0)]) == {} and h(0) in a.get_many([h(0)])
    with pytest.raises(ValueError):
        RedisVisionCache(redis_conn, "bad{tag}", max_bytes=1)


def test_redis_down_is_a_miss_not_an_error(redis_url):
    port = free_port()  # nothing listens there
    connection = redis.Redis(port=port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    cache = RedisVisionCache(connection, "tiny", max_bytes=10**6, cooldown_s=60)
    cache.put_many({h(0): emb(0)})
    assert cache.get_many([h(0)]) == {} and cache.stats.misses == 1
    cache.connection = redis.Redis.from_url(redis_url)  # back, but the cooldown is not over
    cache.put_many({h(0): emb(0)})
    assert cache.connection.dbsize() == 0


def test_engine_side_vision_cache_over_redis(redis_conn):
    shared = RedisVisionCache(redis_conn, "tiny", max_bytes=10**6)
    writer = VisionCache(LocalVisionCache(10**6), shared)
    reader = VisionCache(LocalVisionCache(10**6), shared)  # another worker
    writer.put_many({h(7): emb(7)})
    writer.flush()  # puts are written behind
    assert torch.equal(reader.get_many([h(7)])[h(7)], emb(7))
    assert h(7) in reader.local
