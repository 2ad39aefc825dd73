"""Where one thread spends its time: its Python stack sampled from a daemon thread.

For the worker's loop thread (`WICORE_SAMPLE_STACKS=FILE`, or `sample_stacks` in the config
file): when the device idles, this says what the host was doing instead. A sample is taken
every `interval_s` whenever the sampler gets the GIL, so a thread busy in Python is seen at its
switch points and one waiting in C (a device sync, a socket) at that call.

The report (JSON): `samples`, `interval_s`, and two tables of fractions of the samples:
`innermost` (the innermost `depth` frames, as `function (file:line) < caller < ...`) and
`inclusive` (each function anywhere on the stack: the share of time under it).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

TOP = 40  # rows kept in each table


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"


class StackSampler:
    def __init__(self, thread_id: int | None = None, interval_s: float = 0.002, depth: int = 3):
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.interval_s, self.depth = interval_s, depth
        self.innermost: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self._count(frame)

    def _count(self, frame: FrameType) -> None:
        chain, functions = [], set()
        while frame is not None:
            if len(chain) < self.depth:
                chain.append(_where(frame))
            code = frame.f_code
            functions.add(f"{code.co_name} ({Path(code.co_filename).name})")
            frame = frame.f_back
        self.samples += 1
        self.innermost[" < ".join(chain)] += 1
        self.inclusive.update(functions)

    def report(self) -> dict:
        def table(counts: Counter[str]) -> list[list]:
            return [[where, round(n / self.samples, 4)] for where, n in counts.most_common(TOP)]

        if not self.samples:
            return {"samples": 0, "interval_s": self.interval_s, "innermost": [], "inclusive": []}
        return {
            "samples": self.samples,
            "interval_s": self.interval_s,
            "innermost": table(self.innermost),
            "inclusive": table(self.inclusive),
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"written_at": time.time(), **self.report()}, indent=1))
