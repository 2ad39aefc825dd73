import threading

import torch

from wicore.engines.vision_cache import WRITES_PENDING, EmbeddingStore, LocalVisionCache, VisionCache, tensor_bytes


def emb(i, tokens=4):
    return torch.full((tokens, 8), float(i))  # 4 x 8 fp32 = 128 bytes


def h(i):
    return f"{i:064x}"


def test_local_cache_is_bounded_by_bytes_lru():
    cache = LocalVisionCache(max_bytes=3 * 128)
    for i in range(3):
        assert cache.put(h(i), emb(i))
    assert cache.get(h(0)) is not None  # 0 recent: 1 is evicted next
    cache.put(h(3), emb(3))
    assert h(1) not in cache and len(cache) == 3 and cache.total_bytes == 3 * 128
    assert not cache.put(h(9), emb(9, tokens=16))  # alone over the cap
    assert cache.total_bytes <= cache.max_bytes and cache.stats.evictions == 1


def test_replacing_an_entry_keeps_the_byte_count():
    cache = LocalVisionCache(max_bytes=10_000)
    cache.put(h(0), emb(0))
    cache.put(h(0), emb(0, tokens=8))
    assert cache.total_bytes == tensor_bytes(emb(0, tokens=8)) and len(cache) == 1


class CountingStore(LocalVisionCache):
    """A second local cache playing the shared store; counts batch calls."""

    calls = 0

    def get_many(self, hashes):
        self.calls += 1
        return super().get_many(hashes)


def test_vision_cache_goes_to_the_shared_store_once_per_batch():
    shared = CountingStore(max_bytes=10_000)
    store: EmbeddingStore = shared
    shared.put_many({h(1): emb(1), h(2): emb(2)})
    cache = VisionCache(LocalVisionCache(max_bytes=10_000), store)
    cache.put_many({h(0): emb(0)})
    found = cache.get_many([h(0), h(1), h(2), h(3), h(1)])
    assert sorted(found) == [h(0), h(1), h(2)] and shared.calls == 1
    assert torch.equal(found[h(2)], emb(2))
    assert h(1) in cache.local  # filled from the shared store
    cache.get_many([h(1), h(2)])
    assert shared.calls == 1  # now local hits only
    cache.flush()
    assert h(0) in shared  # puts go to both


class GatedStore(LocalVisionCache):
    """A shared store whose writes wait until the test opens the gate (a slow Redis)."""

    def __init__(self):
        super().__init__(max_bytes=10**6)
        self.entered, self.gate = threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        assert self.gate.wait(10), "the gate never opened"
        super().put_many(items)


def test_shared_puts_are_written_behind_and_never_wait_for_the_store():
    store = GatedStore()
    cache = VisionCache(LocalVisionCache(max_bytes=10**6), store)
    cache.put_many({h(0): emb(0)})
    assert store.entered.wait(10)  # the writer holds the first batch, stuck in the store
    for i in range(1, WRITES_PENDING + 3):  # WRITES_PENDING queue behind it, two more are dropped
        cache.put_many({h(i): emb(i)})  # returns at once though the store is stuck
    assert len(cache.local) == WRITES_PENDING + 3, "the local cache has them all now"
    assert len(store) == 0 and cache.dropped_writes == 2
    store.gate.set()
    cache.flush()
    assert len(store) == WRITES_PENDING + 1
    assert torch.equal(store.get(h(0)), emb(0))
    cache.close()
    cache.put_many({h(99): emb(99)})  # after close: local only
    assert h(99) in cache.local and h(99) not in store


def test_vision_cache_without_a_shared_store():
    cache = VisionCache(LocalVisionCache(max_bytes=1000))
    assert cache.get_many([h(0)]) == {}
    cache.put_many({h(0): emb(0)})
    assert list(cache.get_many([h(0)])) == [h(0)]
