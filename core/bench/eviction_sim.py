"""Trace simulator: hit rates of LRU, A2CR and the offline optimum (Belady's MIN) on Zipf-skewed
traces with one-off scans mixed in, at several cache sizes, with two recompute-cost classes.

    python -m wicore.bench.eviction_sim [--json out.json] [--png out.png] [--quick]

Model: unit-size entries (a cache of C entries), every request is an access; a miss inserts the
key (LRU and A2CR always admit). Keys fall in two cost classes, drawn independently of
popularity: KV prefix blocks (cost 1) and vision embeddings (cost `expensive_cost`). The default
ratio 50 is Gemma-3-4B's: one image through the vision tower is ~5.5 TFLOP, a 16-token KV block
of prefill ~2 x 16 x 3.2e9 = 0.1 TFLOP. Scans are runs of keys never seen again (a batch of
unique images or prompts), every `scan_every` requests.

hit rate = hits / requests; cost-weighted hit rate = recompute cost saved / cost of all requests.
MIN (evict the key used farthest in the future, and bypass a new key used later than every
cached one) is optimal for hit count; it is not the optimum of the cost-weighted rate (weighted
caching has no such simple rule), so that column is only a reference there.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from wicore.engines.kvcache.eviction import A2CR, LRU, EvictionPolicy, GreedyDual

NEVER = math.inf
DEFAULT_HALF_LIFE = 2.0  # A2CR's half-life in accesses, as a multiple of the cache capacity


@dataclass(frozen=True)
class TraceSpec:
    alpha: float  # Zipf exponent: p(rank r) ~ r^-alpha
    n_keys: int = 5_000  # popular universe
    length: int = 50_000  # requests, scans included
    scan_every: int = 2_500  # requests between the starts of two scans; 0 = no scans
    scan_len: int = 500  # keys per scan, each seen once
    churn_every: int = 0  # requests between popularity shifts; 0 = a fixed popularity
    churn_top: int = 500  # at each shift, half of the keys at these top ranks are replaced by new keys
    expensive_fraction: float = 0.2
    expensive_cost: float = 50.0
    seed: int = 0

    @property
    def name(self) -> str:
        scans = f"+scan{self.scan_len}/{self.scan_every}" if self.scan_every else ""
        churn = f"+churn/{self.churn_every}" if self.churn_every else ""
        return f"zipf{self.alpha:g}{scans}{churn}"


@dataclass
class Trace:
    keys: list[int]  # one key per request
    costs: dict[int, float]  # recompute cost per key


def make_trace(spec: TraceSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    ranks = np.arange(1, spec.n_keys + 1, dtype=np.float64)
    probs = ranks**-spec.alpha
    popular = rng.choice(spec.n_keys, size=spec.length, p=probs / probs.sum()).tolist()  # ranks
    rank_to_key = rng.permutation(spec.n_keys)
    keys: list[int] = []
    next_new_key = spec.n_keys  # scans and churn take fresh keys from here
    for i, rank in enumerate(popular):
        if len(keys) >= spec.length:
            break
        if spec.churn_every and i % spec.churn_every == spec.churn_every - 1:
            next_new_key = _churn(rank_to_key, spec.churn_top, next_new_key, rng)
        if spec.scan_every and i % spec.scan_every == spec.scan_every - 1:
            keys.extend(range(next_new_key, next_new_key + spec.scan_len))
            next_new_key += spec.scan_len
        keys.append(int(rank_to_key[rank]))
    keys = keys[: spec.length]
    expensive = rng.random(next_new_key) < spec.expensive_fraction
    costs = {k: (spec.expensive_cost if expensive[k] else 1.0) for k in set(keys)}
    return Trace(keys, costs)


def _churn(rank_to_key: np.ndarray, top: int, next_new_key: int, rng: np.random.Generator) -> int:
    """Half of the top ranks get new keys (new content takes over; the old keys fall silent)."""
    top = min(top, len(rank_to_key))
    ranks = rng.choice(top, size=top // 2, replace=False)
    rank_to_key[ranks] = np.arange(next_new_key, next_new_key + len(ranks))
    return next_new_key + len(ranks)


@dataclass(frozen=True)
class Outcome:
    hits: int
    requests: int
    hit_cost: float
    total_cost: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def cost_hit_rate(self) -> float:
        return self.hit_cost / self.total_cost if self.total_cost else 0.0


def run_policy(policy: EvictionPolicy[int], trace: Trace, capacity: int, uses_cost: bool = True) -> Outcome:
    """Replay `trace` through a cache of `capacity` entries ordered by `policy`. With
    `uses_cost=False` the policy is told every cost is 1 (the rates still count true costs)."""
    hits, hit_cost = 0, 0.0
    for key in trace.keys:
        if key in policy:
            hits += 1
            hit_cost += trace.costs[key]
            policy.touch(key)
            continue
        if len(policy) >= capacity:
            policy.evict()
        policy.insert(key, trace.costs[key] if uses_cost else 1.0)
    return _outcome(trace, hits, hit_cost)


def next_uses(keys: Sequence[int]) -> list[float]:
    """For each request, the index of the next request of the same key (NEVER if none)."""
    out = [NEVER] * len(keys)
    seen: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        out[i] = seen.get(keys[i], NEVER)
        seen[keys[i]] = i
    return out


def run_belady(trace: Trace, capacity: int) -> Outcome:
    """MIN with bypass. Heap of (-next use, key) with lazy invalidation: O(n log n)."""
    nxt = next_uses(trace.keys)
    cached: dict[int, float] = {}  # key -> its next use
    heap: list[tuple[float, int]] = []
    hits, hit_cost = 0, 0.0
    for i, key in enumerate(trace.keys):
        if key in cached:
            hits += 1
            hit_cost += trace.costs[key]
        elif len(cached) >= capacity:
            farthest = _farthest(heap, cached)
            if nxt[i] >= cached[farthest]:
                continue  # bypass: this key is needed no sooner than any cached one
            del cached[farthest]
        cached[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return _outcome(trace, hits, hit_cost)


def _farthest(heap: list[tuple[float, int]], cached: dict[int, float]) -> int:
    while True:
        neg_next, key = heap[0]
        if cached.get(key) == -neg_next:
            return key
        heapq.heappop(heap)  # stale: evicted, or touched since


def _outcome(trace: Trace, hits: int, hit_cost: float) -> Outcome:
    total = sum(trace.costs[k] for k in trace.keys)
    return Outcome(hits, len(trace.keys), hit_cost, total)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    make: Callable[[int], EvictionPolicy[int]]  # capacity -> a fresh policy
    uses_cost: bool = True


def a2cr(half_life: float, uses_cost: bool = True, name: str | None = None) -> PolicySpec:
    """A2CR whose half-life is `half_life` x the cache capacity, in accesses."""
    name = name or f"A2CR(h={half_life:g}C{'' if uses_cost else ',nocost'})"
    return PolicySpec(name, lambda c: A2CR.with_half_life(half_life * c), uses_cost)


def default_policies() -> list[PolicySpec]:
    return [
        PolicySpec("LRU", lambda c: LRU()),
        PolicySpec("GreedyDual", lambda c: GreedyDual()),
        a2cr(DEFAULT_HALF_LIFE, name="A2CR"),
        a2cr(DEFAULT_HALF_LIFE, uses_cost=False, name="A2CR-nocost"),
    ]


def half_life_sweep(half_lives: Sequence[float] = (0.5, 2, 8, 32)) -> list[PolicySpec]:
    policies = [PolicySpec("LRU", lambda c: LRU())]
    for h in half_lives:
        policies += [a2cr(h), a2cr(h, uses_cost=False)]
    return policies


@dataclass
class SimResults:
    rows: list[dict] = field(default_factory=list)  # trace, size, capacity, policy, rates

    def policy_hit_rates(self, weighted: bool = False) -> dict[str, dict[str, float]]:
        """[trace@size][policy] -> hit rate (cost-weighted when `weighted`)."""
        metric = "cost_hit_rate" if weighted else "hit_rate"
        out: dict[str, dict[str, float]] = {}
        for row in self.rows:
            out.setdefault(f"{row['trace']}@{row['size']:g}", {})[row["policy"]] = row[metric]
        return out

    def to_dict(self) -> dict:
        return {
            "policy_hit_rates": self.policy_hit_rates(),
            "cost_weighted_hit_rates": self.policy_hit_rates(weighted=True),
            "rows": self.rows,
        }


def simulate(
    specs: Sequence[TraceSpec],
    sizes: Sequence[float] = (0.01, 0.05, 0.2),
    policies: Sequence[PolicySpec] | None = None,
) -> SimResults:
    """`sizes` are cache capacities as fractions of each trace's popular universe (n_keys)."""
    policies = policies or default_policies()
    results = SimResults()
    for spec in specs:
        trace = make_trace(spec)
        for size in sizes:
            capacity = max(1, round(size * spec.n_keys))
            outcomes = {p.name: run_policy(p.make(capacity), trace, capacity, p.uses_cost) for p in policies}
            outcomes["MIN"] = run_belady(trace, capacity)
            for name, o in outcomes.items():
                row = {"trace": spec.name, "size": size, "capacity": capacity, "policy": name}
                results.rows.append(row | {"hit_rate": o.hit_rate, "cost_hit_rate": o.cost_hit_rate} | asdict(o))
    return results


def plot_hit_rates(results: SimResults, path: str | Path) -> Path:
    """One column per trace; hit rate (top) and cost-weighted hit rate (bottom) vs cache size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in results.rows))
    policies = list(dict.fromkeys(r["policy"] for r in results.rows))
    fig, axes = plt.subplots(2, len(traces), figsize=(4 * len(traces), 6.5), squeeze=False, sharey="row")
    for col, trace in enumerate(traces):
        for row, metric in enumerate(("hit_rate", "cost_hit_rate")):
            ax = axes[row][col]
            for policy in policies:
                pts = [(r["size"], r[metric]) for r in results.rows if r["trace"] == trace and r["policy"] == policy]
                ax.plot(*zip(*pts, strict=True), marker="o", label=policy)
            ax.set_xscale("log")
            ax.set_title(trace if row == 0 else "", fontsize=9)
            ax.set_xlabel("cache size (fraction of popular keys)")
            ax.set_ylabel("hit rate" if metric == "hit_rate" else "cost-weighted hit rate")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def standard_specs(quick: bool = False, expensive_cost: float = 50.0) -> list[TraceSpec]:
    """Zipf 0.8 / 1.0 / 1.2 with scans, each with a fixed popularity and with churn every 2,000
    requests (where a policy's memory of old hits starts to hurt)."""
    length = 10_000 if quick else 40_000
    return [
        TraceSpec(alpha=a, length=length, churn_every=churn, expensive_cost=expensive_cost)
        for churn in (0, 2_000)
        for a in (0.8, 1.0, 1.2)
    ]


def format_table(results: SimResults) -> str:
    """Rows: trace@size; columns: policies; cells: hit rate / cost-weighted hit rate."""
    policies = list(dict.fromkeys(r["policy"] for r in results.rows))
    plain, weighted = results.policy_hit_rates(), results.policy_hit_rates(weighted=True)
    width = max(len(p) for p in policies) + 2
    lines = [f"{'trace@size (hit rate / cost-weighted)':<44}" + "".join(f"{p:>{max(width, 13)}}" for p in policies)]
    for trace, rates in plain.items():
        cells = [f"{rates[p]:.3f}/{weighted[trace][p]:.3f}" for p in policies]
        lines.append(f"{trace:<44}" + "".join(f"{c:>{max(width, 13)}}" for c in cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="write the plot here")
    parser.add_argument("--quick", action="store_true", help="short traces (10k requests)")
    parser.add_argument("--expensive-cost", type=float, default=50.0, help="cost of the expensive class (cheap = 1)")
    parser.add_argument("--sweep", action="store_true", help="compare A2CR half-lives instead of the default policies")
    args = parser.parse_args(argv)
    policies = half_life_sweep() if args.sweep else default_policies()
    results = simulate(standard_specs(args.quick, args.expensive_cost), policies=policies)
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results.to_dict(), indent=1))
    if args.png:
        plot_hit_rates(results, args.png)


if __name__ == "__main__":
    main()
