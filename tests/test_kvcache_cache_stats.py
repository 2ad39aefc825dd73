import json

from wicore.engines.kvcache.cache_stats import CacheStats, TierStats


def test_tier_stats_sum_and_rate():
    a = TierStats(hits=3, misses=1, bytes_in=10)
    b = TierStats(hits=1, misses=3, evictions=2, seconds=0.5)
    total = a + b
    assert (total.hits, total.misses, total.bytes_in, total.evictions, total.seconds) == (4, 4, 10, 2, 0.5)
    assert total.hit_rate == 0.5 and TierStats().hit_rate == 0.0


def test_cache_stats_json_round_trip():
    stats = CacheStats()
    stats.tier("host").record(hits=2, misses=1, bytes_out=64)
    with stats.tier("disk").timed():
        pass
    text = stats.to_json()
    assert json.loads(text)["host"]["hit_rate"] == 2 / 3
    back = CacheStats.from_json(text)
    assert back.tiers["host"] == stats.tiers["host"] and back.tiers["disk"].seconds >= 0


def test_cache_stats_add_merges_tiers():
    a, b = CacheStats(), CacheStats()
    a.tier("host").hits = 1
    b.tier("host").hits = 2
    b.tier("vision").misses = 5
    total = a + b
    assert total.tiers["host"].hits == 3 and total.tiers["vision"].misses == 5
