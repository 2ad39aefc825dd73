"""How much full-size pixel memory a process's image decodes may hold at once.

A decode reserves what it will need (`image_decode.working_bytes`, judged from the header before
any pixel is decoded) and waits until that fits under the budget beside the decodes already running; one
that needs more than the whole budget runs alone. Waiters go in arrival order, so a large image
is not overtaken forever by small ones. When the last decode of a busy spell ends, memory that
glibc's allocator kept (Pillow's 16 MB blocks fall under glibc's adaptive mmap threshold and
stay in its heaps) goes back to the operating system (`malloc_trim`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

# Returning memory to the OS costs a walk of the heap: only after spells that held this much.
TRIM_AFTER_BYTES = 64 * 2**20


class DecodeBudget:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._in_use = 0
        self._spell_peak = 0  # most bytes held since the budget was last idle
        self._waiting: deque[object] = deque()  # a ticket per waiter, by arrival
        self._changed = threading.Condition()

    @contextmanager
    def reserve(self, num_bytes: int) -> Iterator[None]:
        """Hold `num_bytes` of the budget for the block (all of it, when `num_bytes` is more)."""
        need = min(num_bytes, self.capacity)
        self._acquire(need)
        try:
            yield
        finally:
            self._release(need)

    def _acquire(self, need: int) -> None:
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            try:
                self._changed.wait_for(lambda: self._waiting[0] is ticket and self._in_use + need <= self.capacity)
            finally:  # a waiter that gives up (an exception in its thread) passes its turn on too
                self._waiting.remove(ticket)
                self._changed.notify_all()
            self._in_use += need
            self._spell_peak = max(self._spell_peak, self._in_use)

    def _release(self, need: int) -> None:
        with self._changed:
            self._in_use -= need
            trim = self._in_use == 0 and self._spell_peak >= TRIM_AFTER_BYTES
            if self._in_use == 0:
                self._spell_peak = 0
            self._changed.notify_all()
        if trim:
            release_free_memory()


@functools.cache
def budget_of(capacity: int) -> DecodeBudget:
    """This process's budget of that size: every decode thread of a worker (or of one decode
    process) shares it."""
    return DecodeBudget(capacity)


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
