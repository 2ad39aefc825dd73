"""Handles on asynchronous device work: a vision batch on the side stream, sampled tokens on
their way to the host, and per-phase GPU timing. On CPU everything is synchronous and every
handle is born complete."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from wicore.engines.fast.sampler import TokenScores
from wicore.engines.fast.sequence import Sequence

READ_POLL_S = 0.0002  # how often a token read that a vision batch may cut short polls


@dataclass
class VisionJob:
    seqs: list[Sequence]
    event: torch.cuda.Event | None  # recorded on the vision stream after the projector
    embeds: torch.Tensor | None = None  # [distinct images, tokens, hidden]
    keys: list[str | None] = field(default_factory=list)  # image hash of each output row
    attached: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (seq, its rows), joined later

    def done(self) -> bool:
        return self.event is None or self.event.query()


# A sampled token's log-probability and its (id, log-probability) alternatives, best first.
RowScores = tuple[float, list[tuple[int, float]]]


@dataclass
class Readback:
    """Tokens sampled for `seqs` (one each), and their log-probabilities when a row asked for
    them, copied to pinned host memory behind an event, so the host reads them a step later
    without stalling the device."""

    seqs: list[Sequence]
    host: torch.Tensor  # [len(seqs)] int64
    event: torch.cuda.Event | None
    scores: TokenScores | None = None  # on the host

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor, scores: TokenScores | None = None) -> Readback:
        if not tokens.is_cuda:
            return cls(seqs, tokens, None, scores)
        host_scores = None if scores is None else TokenScores(*map(_to_host, vars(scores).values()))
        host = _to_host(tokens)
        event = torch.cuda.Event()
        event.record()
        return cls(seqs, host, event, host_scores)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def row_scores(self) -> list[RowScores | None]:
        """Per row (after `tokens`): its token's log-probability and the alternatives it asked
        for, or None where it asked for no logprobs (the scores hold the asking rows, in order)."""
        if self.scores is None:
            return [None] * len(self.seqs)
        chosen, ids, values = (iter(t.tolist()) for t in vars(self.scores).values())
        rows: list[RowScores | None] = []
        for seq in self.seqs:
            k = seq.top_logprobs
            if k is None:
                rows.append(None)
                continue
            pairs = list(zip(next(ids)[:k], next(values)[:k], strict=True))
            rows.append((next(chosen), pairs))
        return rows


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def poll(done: Callable[[], bool], give_up: Callable[[], bool], interval: float) -> bool:
    """Checks `done` every `interval` seconds until it holds (True) or `give_up` does (False):
    CUDA events have no timed wait, so a wait that may end early polls them."""
    while not done():
        if give_up():
            return False
        time.sleep(interval)
    return True


class Readbacks:
    """Readbacks in launch order, each with the step it was launched in. Tokens are read in
    that order (a sequence's tokens append in order), and only once landed: `landed(due)`
    yields the oldest readbacks while their tokens are on the host, waiting for those
    launched in step `due` or before."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Readback]] = deque()

    def add(self, step: int, readback: Readback) -> None:
        self._queue.append((step, readback))

    def landed(self, due: int, wake: Callable[[], bool] | None = None) -> Iterator[Readback]:
        """`wake`: while a due readback is still on its way, stop waiting for it (and yield no
        more) once this returns True."""
        while self._queue:
            step, readback = self._queue[0]
            if not readback.ready() and (
                step > due or (wake is not None and not poll(readback.ready, wake, READ_POLL_S))
            ):
                return
            yield self._queue.popleft()[1]

    def wait_oldest(self) -> None:
        if self._queue:
            self._queue[0][1].tokens()

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)


TRACE_LAUNCHES = 48  # launches of a start from idle that `PhaseClock.trace` keeps


@dataclass
class PhaseClock:
    """Seconds per phase: CUDA events on the GPU (summed once they complete), wall time on CPU.

    From `begin_trace` (the engine calls it when work arrives at an idle engine) the next
    `TRACE_LAUNCHES` launches are also kept as [phase, start ms, end ms] since that call, on the
    device's clock: where the device idles while a run fills its pipeline."""

    cuda: bool
    seconds: dict[str, float] = field(default_factory=lambda: {"vision": 0.0, "prefill": 0.0, "decode": 0.0})
    pending: list[tuple[str, object, object, bool]] = field(default_factory=list)  # (phase, start, end, traced)
    trace: list[tuple[str, float, float]] = field(default_factory=list)
    _origin: object = None
    _trace_left: int = 0

    def _now(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000.0

    def begin_trace(self) -> None:
        """Trace the launches from now on (an idle device runs the origin event at once)."""
        self._origin, self._trace_left, self.trace = self._now(), TRACE_LAUNCHES, []

    def start(self, stream=None):
        return self._now(stream)

    def stop(self, phase: str, mark, stream=None) -> None:
        traced = self._trace_left > 0
        self._trace_left -= traced
        self.pending.append((phase, mark, self._now(stream), traced))
        if not self.cuda:
            self.collect()

    def collect(self) -> dict[str, float]:
        still = []
        for phase, start, end, traced in self.pending:
            if self.cuda and not end.query():
                still.append((phase, start, end, traced))
                continue
            self.seconds[phase] += self._ms(start, end) / 1000.0
            if traced:
                self.trace.append(
                    (phase, round(self._ms(self._origin, start), 2), round(self._ms(self._origin, end), 2))
                )
        self.pending = still
        return dict(self.seconds)
