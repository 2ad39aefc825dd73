"""Image loading, decoding and resizing in worker processes, off the calling process's GIL.

A process that launches GPU kernels from Python loses time to every thread that holds its GIL:
PIL's decoders release it while they run, but the Python around them (format plugins, EXIF,
mode conversions) takes it hundreds of times an image. Here each image is read, checked,
decoded and resized (`image_load.load_pixels`, ~20 ms of CPU for a 0.8 MP photo to 896 px) in
a spawned process; the caller's process only sends a source (bytes or a path) and receives the
uint8 [H, W, 3] array (2.4 MB at 896 px: ~0.1 ms of unpickling in the pool's result thread).

The processes of a pool share one decode memory budget (`decode_budget`): together they hold no
more full-size pixels at once than one worker's threads would.

At most two tasks per process are in the executor at once; the rest wait here. A process that
dies (a decoder crash, the OOM killer, a signal) breaks a ProcessPoolExecutor and fails every task
in it: the pool is replaced, and each of those tasks runs again alone, before anything else. One
that breaks the pool alone is the culprit: it ends with an `ImageError` line, as a bad image
does, and its batch mates run on.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any

from wicore.errors import ImageError
from wicore.ops.decode_budget import DecodeBudget, use_budget
from wicore.ops.image_load import ImageSource, LoadRules, PixelResult, input_error_message, load_pixels
from wicore.ops.image_preprocess import PreprocessSpec

TASKS_PER_PROCESS = 2  # one running, one queued: no process waits between images


@dataclass
class _Task:
    source: ImageSource
    out: Future  # of PixelResult, or of then(PixelResult): what the caller holds
    then: Callable[[PixelResult], Any] | None = None
    alone: bool = False  # a suspect: it runs with nothing else in the pool
    inner: Future | None = None  # the executor's future, once submitted


class PixelPool:
    def __init__(self, processes: int, spec: PreprocessSpec, rules: LoadRules):
        self.processes, self.spec, self.rules = processes, spec, rules
        self._lock = threading.Lock()
        self._waiting: deque[_Task] = deque()
        self._suspects: deque[_Task] = deque()  # in the pool when a process died
        self._submitted = 0  # tasks in the executor
        self._closed = False
        self._executor = self._start()

    def submit(self, source: ImageSource, then: Callable[[PixelResult], Any] | None = None) -> Future:
        """A future of a `PixelResult` (uint8 [H, W, 3] | None, error line, seconds, sha256), or of
        `then(that)`, called in the pool's result thread. Canceling it drops the work if it has
        not started."""
        task = _Task(source, Future(), then)
        task.out.add_done_callback(partial(_cancel_inner, task))
        with self._lock:
            self._waiting.append(task)
        self._pump()
        return task.out

    def close(self) -> None:
        """Stop the processes; what has not finished is canceled."""
        with self._lock:
            self._closed = True
            left = [*self._waiting, *self._suspects]
            self._waiting.clear()
            self._suspects.clear()
            self._executor.shutdown(wait=False, cancel_futures=True)
        for task in left:
            task.out.cancel()

    def _start(self) -> ProcessPoolExecutor:
        # spawn: never fork a process that holds a CUDA context and threads
        context = multiprocessing.get_context("spawn")
        budget = DecodeBudget(self.rules.limits.budget_bytes, context)  # one per pool: a crash may leak it
        return ProcessPoolExecutor(self.processes, mp_context=context, initializer=_start_decoding, initargs=(budget,))

    def _pump(self) -> None:
        """Move waiting tasks into the executor while it has room (a suspect only into an empty one)."""
        while True:
            with self._lock:
                task = self._next()
                if task is None:
                    return
                self._submitted += 1
                executor = self._executor
            try:
                task.inner = executor.submit(load_pixels, task.source, self.rules, self.spec)
            except Exception as error:  # broken or closed meanwhile, or no process could start
                self._landed(task, executor, _failed(error))
                continue
            task.inner.add_done_callback(partial(self._landed, task, executor))

    def _next(self) -> _Task | None:
        if self._closed:
            return None
        if self._suspects:
            return self._suspects.popleft() if not self._submitted else None
        while self._waiting and self._waiting[0].out.cancelled():
            self._waiting.popleft()
        if self._waiting and self._submitted < TASKS_PER_PROCESS * self.processes:
            return self._waiting.popleft()
        return None

    def _landed(self, task: _Task, executor: ProcessPoolExecutor, inner: Future) -> None:
        """In the pool's result thread: hand the result over, or set a crash's tasks apart."""
        with self._lock:
            self._submitted -= 1
        if inner.cancelled():
            task.out.cancel()
        elif not (isinstance(inner.exception(), BrokenProcessPool) and self._suspect(task, executor)):
            _deliver(task, _result(inner))
        self._pump()

    def _suspect(self, task: _Task, broken: ProcessPoolExecutor) -> bool:
        """After a crash: a fresh pool (whoever sees the crash first starts it), and the task
        queued to run alone. False when it ran alone already (the culprit) or the pool is closed:
        it ends with the error."""
        with self._lock:
            if self._closed:
                return False
            if self._executor is broken:
                self._executor = self._start()
            if task.alone:
                return False
            task.alone = True
            self._suspects.append(task)
            return True


def _result(inner: Future) -> PixelResult:
    error = inner.exception()
    if isinstance(error, BrokenProcessPool):
        return PixelResult(None, f"{ImageError.__name__}: the image decoding process died on this image ({error})", 0.0)
    if error is not None:
        return PixelResult(None, input_error_message(error), 0.0)
    return inner.result()


def _deliver(task: _Task, result: PixelResult) -> None:
    with contextlib.suppress(InvalidStateError):  # the caller canceled it meanwhile
        try:
            value = result if task.then is None else task.then(result)
        except Exception as error:  # the caller's own function: its error is the caller's to read
            task.out.set_exception(error)
            return
        task.out.set_result(value)


def _cancel_inner(task: _Task, out: Future) -> None:
    if out.cancelled() and task.inner is not None:
        task.inner.cancel()


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _start_decoding(budget: DecodeBudget) -> None:
    """Decode processes share their pool's memory budget. They stop when their pool closes or
    their parent dies, never on the Ctrl-C or SIGTERM meant for the worker (which finishes its
    jobs in hand with them)."""
    use_budget(budget)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
