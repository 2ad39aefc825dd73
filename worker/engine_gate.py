"""The worker's side of the engine: how many requests the engine may hold at once, and what
happens when a batch runs out of device memory.

An out-of-memory error (torch.OutOfMemoryError on CUDA; see `engines.base.is_out_of_memory`) is
nobody's input error and nothing to retry through Redis: the gate halves the number of requests
the engine may hold and gives the failed requests to it again, first, in the smaller batch.
Only a request that runs out of memory alone fails (transient: another worker may have room).
After `regrow_after` steps without an OOM the limit doubles again, up to the engine's batch size.

A request for n > 1 samples enters the gate as n requests and leaves it as one completion
(`engines.samples`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from wicore.engines.base import Completion, Engine, EngineRequest, aborted, failed
from wicore.engines.samples import SampleGroups

log = logging.getLogger(__name__)


class EngineGate:
    def __init__(self, engine: Engine, regrow_after: int = 32):
        self.engine = engine
        self.most = max(1, engine.config.max_batch_size)
        self.limit = self.most  # requests the engine may hold now
        self.regrow_after = regrow_after
        self.waiting: deque[EngineRequest] = deque()  # handed to the gate, not yet to the engine; by lane
        self.held: dict[str, EngineRequest] = {}  # in the engine, kept to run again after an OOM
        self._clean_steps = 0
        self.last_step_ok = True  # the last engine call did not raise (the worker's readiness probe)
        self.samples = SampleGroups()

    def free_slots(self) -> int:
        room = min(self.engine.free_slots(), self.limit - len(self.held))
        return max(0, room - len(self.waiting))

    def busy(self) -> bool:
        return bool(self.held or self.waiting or self.engine.num_unfinished())

    def add(self, requests: list[EngineRequest]) -> list[Completion]:
        """Queue requests for the engine, by lane (`EngineRequest.priority`) then arrival;
        returns the ones that ended at once (rejected)."""
        self.waiting = deque(sorted([*self.waiting, *self.samples.split(requests)], key=lambda r: r.priority.rank))
        return self.samples.merge(self._feed())

    def step(self) -> list[Completion]:
        """One engine step (when it holds anything), then refill it from the waiting requests."""
        holds = self.held or self.engine.num_unfinished()  # the engine may hold what a failed add left
        done = self._settle(self._run(self.engine.step, list(self.held.values()))) if holds else []
        return self.samples.merge(done + self._feed())

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """`Engine.abort` for the requests in the gate's hands too: those still waiting stop now;
        the engine's stop now or in a later step, as the engine decides."""
        wanted = self.samples.expand(request_ids)
        stopped = [aborted(r.id) for r in self.waiting if r.id in wanted]
        self.waiting = deque(r for r in self.waiting if r.id not in wanted)
        for completion in self.engine.abort(wanted):
            self.held.pop(completion.id, None)
            stopped.append(completion)
        return self.samples.merge(stopped)

    def _feed(self) -> list[Completion]:
        room = min(self.engine.free_slots(), self.limit - len(self.held))
        batch = [self.waiting.popleft() for _ in range(min(max(0, room), len(self.waiting)))]
        if not batch:
            return []
        self.held.update((r.id, r) for r in batch)
        return self._settle(self._run(lambda: self.engine.add(batch), batch))

    def _run(self, call, requests: list[EngineRequest]) -> list[Completion]:
        """`call()`, with an exception turned into a failed completion per request it held."""
        try:
            done = call()
        except Exception as error:
            self.last_step_ok = False
            log.warning(
                "engine %s raised %s; its %d requests fail", self.engine.name, type(error).__name__, len(requests)
            )
            return [failed(r.id, error, input_error=False) for r in requests]
        self.last_step_ok = True
        return done

    def _settle(self, completions: list[Completion]) -> list[Completion]:
        """Completions that end their jobs; requests that ran out of memory beside others wait
        (first in line) for a smaller batch."""
        holding = len(self.held)
        shrink = holding > 1 and any(c.out_of_memory and c.id in self.held for c in completions)
        ended, again = [], []
        for c in completions:
            request = self.held.pop(c.id, None)
            if shrink and c.out_of_memory and request is not None:
                again.append(request)
            else:
                ended.append(c)
        self.waiting.extendleft(reversed(again))
        if shrink:
            self._shrink(holding)
        else:
            self._regrow()
        return ended

    def _shrink(self, holding: int) -> None:
        self.limit = max(1, min(self.limit, holding) // 2)
        self._clean_steps = 0
        log.warning(
            "engine %s ran out of memory with %d requests; trying %d at a time", self.engine.name, holding, self.limit
        )

    def _regrow(self) -> None:
        self._clean_steps += 1
        if self.limit < self.most and self._clean_steps >= self.regrow_after:
            self.limit = min(self.most, self.limit * 2)
            self._clean_steps = 0
