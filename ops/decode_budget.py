"""How much full-size pixel memory image decodes may hold at once: in one process's threads, or
across the decode processes a budget is handed to when they start.

A decode reserves what it will need (`image_decode.working_bytes`, judged from the header before
any pixel is decoded), in units, and waits until they are free; one that needs more than the
whole budget takes all of it and runs alone. One reservation collects its units at a time, so
two never wait on each other half-served, and a large image is not overtaken by small ones.
After a large decode, memory glibc's allocator kept goes back to the operating system
(`malloc_trim`): Pillow allocates images in 16 MB blocks, which fall under glibc's adaptive mmap
threshold once one has been freed and then stay in its heaps.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import BaseContext

UNIT = 2**20  # bytes per unit reserved
# Returning memory to the OS costs a walk of the heap: only after decodes that held this much.
TRIM_AFTER_BYTES = 64 * 2**20


class DecodeBudget:
    def __init__(self, capacity: int, context: BaseContext | None = None, unit: int = UNIT):
        """`context`: a multiprocessing context, for a budget that processes of that context share
        (pass it to them as they start: `use_budget`); None: this process's threads only."""
        self.capacity, self.unit = capacity, unit
        self.units = max(1, capacity // unit)
        sync = threading if context is None else context
        self._turn = sync.Lock()  # held while one reservation collects its units
        self._free = sync.Semaphore(self.units)

    @contextmanager
    def reserve(self, num_bytes: int) -> Iterator[None]:
        """Hold `num_bytes` of the budget (all of it, when `num_bytes` is more) for the block."""
        units = min(self.units, max(1, -(-num_bytes // self.unit)))
        taken = 0
        try:
            with self._turn:
                for _ in range(units):
                    self._free.acquire()
                    taken += 1
            yield
        finally:
            for _ in range(taken):
                self._free.release()
            if taken * self.unit >= TRIM_AFTER_BYTES:
                release_free_memory()


_budgets: dict[int, DecodeBudget] = {}  # this process's, by capacity
_budgets_lock = threading.Lock()


def budget_of(capacity: int) -> DecodeBudget:
    """The budget of that capacity that this process's decodes share: the one handed over by
    `use_budget`, else one for its threads."""
    with _budgets_lock:
        if capacity not in _budgets:
            _budgets[capacity] = DecodeBudget(capacity)
        return _budgets[capacity]


def use_budget(budget: DecodeBudget) -> None:
    """In a decode process as it starts: decodes here take their memory from `budget`, which
    other processes share."""
    with _budgets_lock:
        _budgets[budget.capacity] = budget


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc only; elsewhere nothing to do)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS): no malloc_trim
        return None
