"""Where one thread spends its time: its Python stack sampled from a daemon thread.

For the worker's loop thread (`WICORE_SAMPLE_STACKS=FILE`, or `sample_stacks` in the config
file): when the device idles, this says what the host was doing instead. A sample is taken
every `interval_s` whenever the sampler gets the GIL, so a thread busy in Python is seen at its
switch points and one waiting in C (a device sync, a socket) at that call.

The report (JSON): `samples`, `interval_s`, and two tables of fractions of the samples:
`innermost` (the innermost `depth` frames, as `function (file:line) < caller < ...`) and
`inclusive` (each function anywhere on the stack: the share of time under it). The last
`RECENT_SAMPLES` samples are kept with their wall time too (`recent`), so a reader can ask what
the thread did in one stretch of its run (`innermost_between`), e.g. while a benchmark's device
idled at its start.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from types import FrameType

TOP = 40  # rows kept in each table
RECENT_SAMPLES = 60_000  # ~2 minutes at the default interval


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
        self.recent: deque[tuple[float, str]] = deque(maxlen=RECENT_SAMPLES)  # (wall time, innermost)
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
            # stamped before the read: the stack read is the thread's at that time or later, so a
            # sample stamped after some moment never shows what the thread had left by then
            taken_at = time.time()
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self._count(frame, taken_at)

    def _count(self, frame: FrameType, taken_at: float) -> None:
        chain, functions = [], set()
        while frame is not None:
            if len(chain) < self.depth:
                chain.append(_where(frame))
            code = frame.f_code
            functions.add(f"{code.co_name} ({Path(code.co_filename).name})")
            frame = frame.f_back
        self.samples += 1
        innermost = " < ".join(chain)
        self.innermost[innermost] += 1
        self.recent.append((taken_at, innermost))
        self.inclusive.update(functions)

    def report(self) -> dict:
        if not self.samples:
            return {"samples": 0, "interval_s": self.interval_s, "innermost": [], "inclusive": [], "recent": {}}
        places = list(dict.fromkeys(where for _, where in self.recent))
        index = {where: i for i, where in enumerate(places)}
        return {
            "samples": self.samples,
            "interval_s": self.interval_s,
            "innermost": _table(self.innermost, self.samples),
            "inclusive": _table(self.inclusive, self.samples),
            # the last samples as [wall time, row of `places`]: `innermost_between` reads them
            "recent": {"places": places, "samples": [[round(t, 4), index[w]] for t, w in self.recent]},
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"written_at": time.time(), **self.report()}, indent=1))


def _table(counts: Counter[str], samples: int) -> list[list]:
    """The `TOP` commonest rows as fractions of `samples`."""
    return [[where, round(n / samples, 4)] for where, n in counts.most_common(TOP)]


def innermost_between(report: dict, start: float, end: float) -> dict:
    """The `innermost` table of a written report's recent samples taken in [start, end] (wall
    time), with how many there were."""
    recent = report.get("recent") or {}
    places = recent.get("places", [])
    counts = Counter(places[i] for t, i in recent.get("samples", []) if start <= t <= end)
    samples = sum(counts.values())
    return {"samples": samples, "innermost": _table(counts, samples) if samples else []}
