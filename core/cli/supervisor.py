"""`wicore worker --gpus all|0,1,...` (or `--workers N`): one `wicore worker` process per GPU,
kept running.

- A worker that crashes or is killed starts again after 1, 2, 4 ... seconds (at most
  RESTART_MAX_S; a worker that ran STEADY_S starts from 1 s again). The jobs it held go back
  to their queues the usual way: a live worker's reaper requeues a dead worker's claims once
  its RQ worker key expires, or the worker itself does when it starts again under its name.
- A worker that exits with a usage error (exit status 2: its settings are wrong) is not started
  again: the others stop, and the supervisor ends with that worker's one-line error and status.
- A worker that exits by itself with status 0 (--burst, --max-jobs) is done; once all are, so
  is the supervisor.
- SIGTERM or SIGINT once: every worker gets SIGTERM (warm: finish what it holds, take
  nothing new). Again, or after WARM_STOP_S: SIGTERM again (cold: claims go back to their queues
  now). A worker still running COLD_STOP_S after that gets SIGKILL.

Process management only: no torch, no Redis here (the workers own both).
"""

from __future__ import annotations

import enum
import math
import signal
import time
from dataclasses import dataclass

from wicore.cli.common import console
from wicore.cli.failures import ExitCode
from wicore.cli.logs import level_or
from wicore.cli.pool import COLD_STOP_S, WARM_STOP_S, WorkerPool, WorkersDied
from wicore.cli.process_group import ProcessGroup
from wicore.cli.worker_specs import WorkerSpec
from wicore.config import Settings

RESTART_FIRST_S = 1.0
RESTART_MAX_S = 60.0
STEADY_S = 60.0  # a worker that ran this long had no start-up trouble: its backoff starts over
POLL_S = 0.2  # also the gap between a worker's two SIGTERMs (two before its handler runs count as one)
FATAL_CODES = (ExitCode.USAGE,)  # the worker's settings are wrong: every restart would fail the same way


class Stage(enum.IntEnum):
    RUNNING = 0
    WARM = 1  # each worker has been sent one SIGTERM
    COLD = 2  # ... and a second
    KILL = 3


class State(enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"  # exited; starts again at `restart_at`
    ENDED = "ended"  # done, or stopped for good


@dataclass
class Slot:
    """The supervisor's view of one worker."""

    started_at: float
    state: State = State.RUNNING
    failures: int = 0  # in a row
    restart_at: float = math.inf
    sigterms: int = 0  # sent to its current process


def restart_delay(failures: int) -> float:
    """Seconds before the restart that follows the `failures`-th failure in a row: 1, 2, 4, ..."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** max(0, failures - 1))


def exit_reason(code: int) -> str:
    """'exited with status 70', 'was killed by SIGKILL' (Popen's returncode -9)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Supervisor:
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.slots: list[Slot] = []
        self.stage = Stage.RUNNING
        self.deadline = math.inf  # when the stop moves on to its next stage
        self.failure: WorkersDied | None = None

    def run(self) -> int:
        """Run the workers until they are all done or stopped. Returns 0, or raises WorkersDied
        with the one-line error of a worker that cannot start."""
        for signum in (signal.SIGTERM, signal.SIGINT):  # as a plain worker takes them
            signal.signal(signum, self._on_signal)
        with self.pool:
            self.slots = [Slot(started_at=time.monotonic()) for _ in self.pool.specs]
            console.print(f"supervising {len(self.slots)} workers: {self._pids()}", markup=False)
            while any(slot.state is not State.ENDED for slot in self.slots):
                self._watch(time.monotonic())
                time.sleep(POLL_S)
        if self.failure is not None:
            raise self.failure
        console.print(f"{len(self.slots)} workers stopped", markup=False)
        return 0

    def _pids(self) -> str:
        return ", ".join(f"{spec.name} (pid {p.pid})" for spec, p in zip(self.pool.specs, self.pool.processes))

    def _on_signal(self, signum, frame) -> None:
        self._next_stage()

    def _next_stage(self) -> None:
        self.stage = Stage(min(self.stage + 1, Stage.KILL))
        self.deadline = time.monotonic() + (WARM_STOP_S if self.stage == Stage.WARM else COLD_STOP_S)

    def _watch(self, now: float) -> None:
        if self.stage != Stage.RUNNING and now >= self.deadline:
            self._next_stage()
        for index, slot in enumerate(self.slots):
            process = self.pool.processes[index]
            if slot.state is State.RUNNING and process.poll() is not None:
                self._exited(index, process.returncode, now)
            elif slot.state is State.WAITING and self.stage != Stage.RUNNING:
                slot.state = State.ENDED
            elif slot.state is State.WAITING and now >= slot.restart_at:
                self._restart(index, now)
            elif slot.state is State.RUNNING and self.stage != Stage.RUNNING:
                self._stop(index)

    def _stop(self, index: int) -> None:
        """One step of the stop per call: a SIGTERM per stage, or SIGKILL at the end."""
        slot, process = self.slots[index], self.pool.processes[index]
        if self.stage == Stage.KILL:
            console.print(f"worker {self.pool.specs[index].name} did not stop in time: killed", markup=False)
            process.kill()
            process.wait()
        elif slot.sigterms < self.stage:
            process.send_signal(signal.SIGTERM)
            slot.sigterms += 1

    def _exited(self, index: int, code: int, now: float) -> None:
        slot, spec = self.slots[index], self.pool.specs[index]
        if code == 0 or self.stage != Stage.RUNNING:
            slot.state = State.ENDED
            return
        error = self.pool.last_error(index, any_line=False)
        if code in FATAL_CODES:
            self.failure = self.failure or WorkersDied(f"worker {spec.name}: {error or exit_reason(code)}", code)
            slot.state = State.ENDED
            self._next_stage()
            return
        slot.failures = 1 if now - slot.started_at >= STEADY_S else slot.failures + 1
        delay = restart_delay(slot.failures)
        slot.state, slot.restart_at = State.WAITING, now + delay
        said = f" ({error})" if error else ""
        console.print(f"worker {spec.name} {exit_reason(code)}{said}; starting it again in {delay:.0f}s", markup=False)

    def _restart(self, index: int, now: float) -> None:
        process = self.pool.start(index)
        self.slots[index] = Slot(started_at=now, failures=self.slots[index].failures)
        console.print(f"worker {self.pool.specs[index].name} started again (pid {process.pid})", markup=False)


def supervise(settings: Settings, specs: list[WorkerSpec], worker_args: list[str]) -> int:
    """Run `specs` under a Supervisor, in a process group of their own: nothing outlives it."""
    group = ProcessGroup()
    logged = settings.model_copy(update={"log_level": level_or(settings, "INFO")})  # a worker's log is its output
    try:
        return Supervisor(WorkerPool(specs, logged, worker_args, group)).run()
    finally:
        group.kill()
