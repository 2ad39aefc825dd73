import functools
import random

import pytest

from wicore.bench.eviction_sim import (
    Trace,
    TraceSpec,
    default_policies,
    make_trace,
    next_uses,
    plot_hit_rates,
    run_belady,
    run_policy,
    simulate,
)
from wicore.engines.kvcache.eviction import LRU


def trace_of(keys: str) -> Trace:
    return Trace(list(map(ord, keys)), {ord(k): 1.0 for k in keys})


def test_belady_on_a_hand_checked_trace():
    # capacity 2: a b miss; c bypassed (never used again); a b hit; d bypassed; a b hit
    trace = trace_of("abcabdab")
    assert run_belady(trace, 2).hits == 4
    assert run_policy(LRU(), trace, 2).hits == 0  # LRU always evicts what comes next


def best_hits(keys: tuple[int, ...], capacity: int) -> int:
    """Exhaustive search over every admission and eviction choice."""

    @functools.cache
    def go(i: int, cache: frozenset) -> int:
        if i == len(keys):
            return 0
        key = keys[i]
        if key in cache:
            return 1 + go(i + 1, cache)
        options = [go(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(go(i + 1, cache | {key}))
        else:
            options += [go(i + 1, (cache - {old}) | {key}) for old in cache]
        return max(options)

    return go(0, frozenset())


@pytest.mark.parametrize("seed", range(20))
def test_belady_is_optimal_on_small_traces(seed):
    rng = random.Random(seed)
    keys = tuple(rng.randrange(5) for _ in range(12))
    trace = Trace(list(keys), dict.fromkeys(keys, 1.0))
    for capacity in (1, 2, 3):
        assert run_belady(trace, capacity).hits == best_hits(keys, capacity)


def test_next_uses():
    assert next_uses([1, 2, 1, 1]) == [2, float("inf"), 3, float("inf")]


def test_trace_has_scans_costs_and_is_seeded():
    spec = TraceSpec(alpha=1.0, n_keys=100, length=1000, scan_every=200, scan_len=20, churn_every=300)
    trace = make_trace(spec)
    assert len(trace.keys) == 1000
    assert trace.keys == make_trace(spec).keys
    scanned = [k for k in trace.keys if k >= spec.n_keys]
    assert len(scanned) >= 4 * 20  # scans and churned keys
    assert set(trace.costs.values()) == {1.0, spec.expensive_cost}


def test_simulate_shape_and_bounds():
    specs = [TraceSpec(alpha=a, n_keys=200, length=2000, scan_every=500, scan_len=50) for a in (0.8, 1.2)]
    results = simulate(specs, sizes=(0.05, 0.2))
    rates = results.policy_hit_rates()
    weighted = results.policy_hit_rates(weighted=True)
    names = [p.name for p in default_policies()] + ["MIN"]
    assert len(rates) == 4 and all(list(r) == names for r in rates.values())
    for trace, by_policy in rates.items():
        assert all(0.0 <= v <= 1.0 for v in by_policy.values())
        assert by_policy["MIN"] >= max(by_policy.values()) - 1e-12  # MIN maximises hits
        assert set(weighted[trace]) == set(names)
    assert rates["zipf1.2+scan50/500@0.2"]["LRU"] > rates["zipf0.8+scan50/500@0.05"]["LRU"]


def test_plot_writes_a_png(tmp_path):
    results = simulate([TraceSpec(alpha=1.0, n_keys=100, length=500)], sizes=(0.1, 0.3))
    path = plot_hit_rates(results, tmp_path / "sim.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
