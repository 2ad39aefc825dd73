"""A thread pool that starts the best-ranked task first, first come within a rank: the image work
of a high-lane job (decoding in the worker, resizing in the engine) does not wait behind the
backlog a large bulk claim leaves. The part of `ThreadPoolExecutor`'s interface wicore uses."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

DEFAULT_RANK = 1  # `Lane.NORMAL.rank`


class PriorityPool:
    def __init__(self, threads: int, name: str):
        self._queue: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []  # a heap
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, rank: int = DEFAULT_RANK) -> Future:
        """`fn(*args)` in a pool thread once no task of a better (lower) rank is waiting."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            heapq.heappush(self._queue, (rank, next(self._order), future, fn, args))
            self._ready.notify()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No new tasks; `cancel_futures` cancels the waiting ones (running ones finish)."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                for task in self._queue:
                    task[2].cancel()
                self._queue.clear()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while (task := self._next()) is not None:
            _, _, future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # the future carries it to the caller, as ThreadPoolExecutor does
                future.set_exception(error)

    def _next(self):
        """The best waiting task; None once the pool is shut down and has none left."""
        with self._ready:
            while not self._queue and not self._closed:
                self._ready.wait()
            return heapq.heappop(self._queue) if self._queue else None
