from wicore.engines.kvcache.cache_stats import CacheStats, TierStats


def test_tier_stats_record_and_rate():
    stats = TierStats()
    stats.record(hits=3, misses=1, bytes_out=64)
    stats.record(hits=1, misses=3)
    assert (stats.hits, stats.misses, stats.lookups, stats.bytes_out) == (4, 4, 8, 64)
    assert stats.hit_rate == 0.5 and TierStats().hit_rate == 0.0


def test_timed_adds_the_time_spent():
    stats = TierStats()
    with stats.timed():
        pass
    first = stats.seconds
    with stats.timed():
        sum(range(1000))
    assert 0 <= first <= stats.seconds


def test_cache_stats_report_every_tier_with_its_hit_rate():
    stats = CacheStats({"host": TierStats(hits=2, misses=1, bytes_out=64), "disk": TierStats(corrupt=1)})
    report = stats.to_dict()
    assert set(report) == {"host", "disk"}
    assert report["host"]["hit_rate"] == 2 / 3 and report["host"]["bytes_out"] == 64
    assert report["disk"]["corrupt"] == 1 and report["disk"]["hit_rate"] == 0.0
