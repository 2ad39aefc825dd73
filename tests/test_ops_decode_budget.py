"""wicore.ops.decode_budget: reservations from real threads and spawned processes, and memory
given back to the OS by a real process."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from wicore.ops.decode_budget import DecodeBudget, budget_of, use_budget


class Holdings:
    """What the threads inside `reserve` hold together, and the most they ever held."""

    def __init__(self):
        self.now = self.most = 0
        self.lock = threading.Lock()

    def hold(self, budget: DecodeBudget, num_bytes: int, seconds: float = 0.01) -> None:
        with budget.reserve(num_bytes):
            with self.lock:
                self.now += min(num_bytes, budget.capacity)
                self.most = max(self.most, self.now)
            time.sleep(seconds)
            with self.lock:
                self.now -= min(num_bytes, budget.capacity)


def test_concurrent_reservations_stay_within_the_capacity():
    budget, held = DecodeBudget(100, unit=1), Holdings()
    sizes = [10, 60, 30, 45, 5, 90, 20, 55, 35, 70] * 3
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: held.hold(budget, n), sizes))
    assert 90 <= held.most <= 100


def test_a_reservation_over_the_capacity_runs_alone():
    budget, held = DecodeBudget(100, unit=1), Holdings()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: held.hold(budget, n), [10, 500, 10, 10, 500, 10]))
    assert held.most == 100


def test_waiters_go_in_arrival_order():
    budget, started = DecodeBudget(100, unit=1), []
    release = threading.Event()

    def take(name: str, num_bytes: int, wait: threading.Event | None = None) -> None:
        with budget.reserve(num_bytes):
            started.append(name)
            if wait is not None:
                wait.wait(10)

    first = threading.Thread(target=take, args=("first", 60, release))
    first.start()
    while not started:
        time.sleep(0.001)
    large = threading.Thread(target=take, args=("large", 50))
    large.start()
    time.sleep(0.05)  # queued: 60 + 50 > 100
    small = threading.Thread(target=take, args=("small", 10))
    small.start()
    time.sleep(0.05)  # 60 + 10 fits, but the large one came first
    assert started == ["first"]
    release.set()
    for thread in (first, large, small):
        thread.join(10)
    assert started == ["first", "large", "small"]


def test_one_budget_per_capacity_in_a_process():
    assert budget_of(123) is budget_of(123) and budget_of(123) is not budget_of(124)


def test_a_reservation_counts_whole_units():
    budget = DecodeBudget(10 * 2**20)
    assert budget.units == 10
    one_more = threading.Thread(target=lambda: budget.reserve(1).__enter__())
    with budget.reserve(1), budget.reserve(2**20 + 1), budget.reserve(7 * 2**20):  # 1 + 2 + 7 units
        one_more.start()
        one_more.join(0.2)
        assert one_more.is_alive()  # waits: all ten units are held
    one_more.join(10)
    assert not one_more.is_alive()


def hold_shared(budget: DecodeBudget, spans) -> None:
    """In a spawned process: hold the whole budget for 0.3 s, noting when."""
    use_budget(budget)
    with budget_of(budget.capacity).reserve(budget.capacity):
        start = time.monotonic()
        time.sleep(0.3)
        spans.put((start, time.monotonic()))


def test_processes_handed_one_budget_share_it():
    context = multiprocessing.get_context("spawn")
    budget, spans = DecodeBudget(4 * 2**20, context), context.Queue()
    processes = [context.Process(target=hold_shared, args=(budget, spans)) for _ in range(3)]
    for process in processes:
        process.start()
    found = sorted(spans.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(30)
    assert all(process.exitcode == 0 for process in processes)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(found, found[1:])), found


GIVE_BACK = """
import threading
from pathlib import Path
import numpy as np
from wicore.ops.decode_budget import budget_of

def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024

def churn():
    for _ in range(20):  # 16 MB blocks, as Pillow allocates an image, freed and allocated again
        with budget_of(2**30).reserve(2**28):
            blocks = [np.ones(2**24, dtype=np.uint8) for _ in range(12)]
            del blocks

before = rss_mb()
threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(round(rss_mb() - before))
"""


def test_memory_freed_by_decodes_goes_back_to_the_os():
    """glibc keeps freed 16 MB blocks in its heaps once its mmap threshold has risen past them."""
    grown = subprocess.run([sys.executable, "-c", GIVE_BACK], capture_output=True, text=True, check=True, timeout=120)
    assert int(grown.stdout) < 32, grown.stdout
