"""The priority pool: the best-ranked waiting task starts first, first come within a rank;
errors reach the caller; shutdown cancels what waits."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import wait_until
from wicore.priority_pool import PriorityPool


def busy_pool() -> tuple[PriorityPool, threading.Event]:
    """A one-thread pool whose thread is held until the event is set: what is submitted waits."""
    pool, release = PriorityPool(1, "test-pool"), threading.Event()
    held = pool.submit(release.wait)
    wait_until(held.running, 10, what="the pool thread to be busy")
    return pool, release


def test_the_best_rank_starts_first_then_first_come():
    pool, release = busy_pool()
    started: list[str] = []
    futures = [
        pool.submit(started.append, name, rank=rank) for name, rank in [("n0", 1), ("l0", 2), ("n1", 1), ("h0", 0)]
    ]
    release.set()
    for future in futures:
        future.result(timeout=10)
    assert started == ["h0", "n0", "n1", "l0"]
    pool.shutdown()


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    pool = PriorityPool(1, "test-pool")
    assert isinstance(pool.submit(int, "not a number").exception(timeout=10), ValueError)
    assert pool.submit(int, "7").result(timeout=10) == 7
    pool.shutdown()


def test_shutdown_cancels_waiting_tasks_and_refuses_new_ones():
    pool, release = busy_pool()
    waiting = pool.submit(print, "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print, "late")
    release.set()
    pool.shutdown()  # joins the thread once its task ends
