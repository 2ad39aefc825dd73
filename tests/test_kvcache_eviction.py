import random

import pytest

from wicore.engines.kvcache.eviction import A2CR, LRU, EvictionPolicy, GreedyDual

POLICIES = [LRU, lambda: A2CR(decay=0.01), GreedyDual]


def fill(policy: EvictionPolicy, keys, cost=1.0):
    for key in keys:
        policy.insert(key, cost)
    return policy


def test_lru_order():
    policy = fill(LRU(), "abcd")
    policy.touch("a")
    assert [policy.evict() for _ in range(4)] == list("bcda")
    assert policy.evict() is None


@pytest.mark.parametrize("make", POLICIES)
def test_pinned_is_never_evicted(make):
    policy = fill(make(), "abc")
    for key in "abc":
        policy.touch(key)
    policy.pin("a")
    policy.pin("b")
    policy.pin("b")
    assert policy.evict() == "c"
    assert policy.victim() is None and len(policy) == 2
    policy.unpin("b")
    assert policy.victim() is None  # still pinned once
    policy.unpin("b")
    assert policy.evict() == "b"
    policy.unpin("a")
    assert policy.evict() == "a"


@pytest.mark.parametrize("make", POLICIES)
def test_remove_and_unknown_keys(make):
    policy = fill(make(), "ab")
    policy.pin("a")
    policy.remove("a")
    assert "a" not in policy and len(policy) == 1
    with pytest.raises(KeyError):
        policy.remove("zz")
    with pytest.raises(KeyError):
        policy.touch("zz")
    with pytest.raises(KeyError):
        policy.unpin("b")
    with pytest.raises(KeyError):
        policy.insert("b")


def test_lru_unpin_counts_as_recent_use():
    policy = fill(LRU(), "abc")
    policy.pin("a")
    policy.unpin("a")
    assert policy.victim() == "b"


def test_a2cr_prefers_frequent_entries():
    policy = fill(A2CR(decay=0.01), "ab")
    for _ in range(3):
        policy.touch("a")
    assert policy.victim() == "b"


def test_a2cr_prefers_costly_entries():
    policy = A2CR(decay=0.01)
    policy.insert("vision", cost=50.0)
    policy.insert("kv", cost=1.0)
    assert policy.victim() == "kv"


def test_a2cr_forgets_old_hits():
    policy = A2CR.with_half_life(10)
    policy.insert("old")
    for _ in range(5):
        policy.touch("old")  # 6 hits
    policy.insert("new")
    assert policy.victim() == "new"
    for i in range(40):  # 4 half-lives of other traffic: 6 / 16 < 1
        policy.insert(i)
        policy.remove(i)
    policy.touch("new")
    assert policy.victim() == "old"


def test_a2cr_victim_is_the_lowest_score():
    """The heap order (fixed priorities) matches the documented score at every step."""
    rng = random.Random(0)
    policy = A2CR(decay=0.05)
    for step in range(2000):
        key = rng.randrange(50)
        if key in policy:
            policy.touch(key)
        else:
            policy.insert(key, cost=rng.choice([1.0, 5.0, 50.0]))
        if len(policy) > 20:
            scores = {k: policy.score(k) for k in policy._entries}
            victim = policy.evict()
            assert scores[victim] == pytest.approx(min(scores.values())), step
    assert len(policy._heap) <= 2 * len(policy) + 64


def test_greedy_dual_with_equal_costs_is_lru():
    rng = random.Random(1)
    lru, gd = LRU(), GreedyDual()
    for _ in range(3000):
        key = rng.randrange(40)
        for policy in (lru, gd):
            if key in policy:
                policy.touch(key)
            else:
                if len(policy) >= 10:
                    policy.evict()
                policy.insert(key)
        assert lru.victim() == gd.victim()


def test_greedy_dual_keeps_costly_entries_longer():
    policy = GreedyDual()
    policy.insert("vision", cost=10.0)
    for i in range(5):
        policy.insert(i)
        assert policy.evict() == i  # the floor rises by 1 per eviction, 10 is far above it


def test_bad_arguments():
    with pytest.raises(ValueError):
        A2CR(decay=-1)
    with pytest.raises(ValueError):
        A2CR().insert("a", cost=0)
