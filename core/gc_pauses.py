"""Python's full garbage collections in a worker process, and keeping the start-up heap out of them.

A worker's heap after start-up (the model's modules, compiled graphs, tokenizer tables) holds
hundreds of thousands to millions of objects that live as long as the process. A full (gen-2)
collection walks every one of them and stops the thread that launches kernels meanwhile: 0.18 s
for the tiny model on a 2-core VM, more on the 4B. `freeze_startup_heap` moves them to the
permanent generation once the engine is built (CPython's `gc.freeze`, as vLLM does), so later full
collections walk only what was allocated since. `GcPauses` times the full collections that still
happen; the worker publishes the figures with its stats.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class GcPauses:
    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.installed = False
        self._started: float | None = None

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._observe)
            self.installed = True

    def _observe(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self.count, self.total_s, self.max_s = self.count + 1, self.total_s + pause, max(self.max_s, pause)
            self._started = None

    def report(self) -> dict:
        """{} until installed."""
        if not self.installed:
            return {}
        return {"gc_full_collections": self.count, "gc_full_pause_s": self.total_s, "gc_full_pause_max_s": self.max_s}


PAUSES = GcPauses()  # the process's: `wicore worker` installs it, the worker loop reports it


def freeze_startup_heap() -> None:
    """Collect once, then keep every object alive now out of later collections (module docstring)."""
    start = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - start
    gc.freeze()
    log.info("gc: %d start-up objects frozen (a full collection over them took %.3f s)", gc.get_freeze_count(), took)
