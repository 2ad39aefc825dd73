"""Worker processes started by a wicore command: `wicore caption` starts and stops them around
its own run, `wicore worker --gpus/--workers` keeps them running (supervisor.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from wicore.cli.failures import ExitCode
from wicore.cli.process_group import ProcessGroup
from wicore.cli.worker_specs import WorkerSpec
from wicore.config import Settings, write_settings_file
from wicore.errors import WicoreError

WARM_STOP_S = 60.0  # a clean end: workers finish what they hold (nothing, normally) and exit
COLD_STOP_S = 10.0  # after a failure or a signal: claimed jobs go back to their queues, then SIGKILL
TAIL_LINES = 50  # of a relayed worker's output, kept for its last words
RELAY_DRAIN_S = 2.0  # how long the last words of an exited worker may take to arrive


class WorkersDied(WicoreError):
    """Every worker process exited before the work was done, or one could not start at all."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class WorkerPool:
    """One `wicore worker` subprocess per spec (each loads the model once; none forks), in the
    run's process group. They get `settings` in a 0600 file of a private folder and none of this
    process's WICORE_ variables: a worker runs with exactly the settings it was given, plus its
    spec's flags and environment (and no password shows in its argv). Each writes its output to
    `<log_dir>/<name>.log`, or, without a `log_dir`, to this process's stderr, line by line under
    its name."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        settings: Settings,
        worker_args: list[str],
        group: ProcessGroup,
        log_dir: Path | None = None,
    ):
        self.specs = specs
        self.settings = settings
        self.worker_args = worker_args
        self.group = group
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.relays: list[Relay | None] = [None] * len(specs)
        self.settings_dir: Path | None = None
        self.settings_file: Path | None = None
        self.env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WICORE_")}

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def logs(self) -> list[Path]:
        return [self.log_dir / f"{name}.log" for name in self.names] if self.log_dir else []

    def __enter__(self) -> WorkerPool:
        self.settings_dir = Path(tempfile.mkdtemp(prefix="wicore-settings-"))  # mode 0700
        try:
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
            self.settings_file = write_settings_file(self.settings, self.settings_dir)
            for index in range(len(self.specs)):
                self.processes.append(self._popen(index))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def start(self, index: int) -> subprocess.Popen:
        """Start the worker of `specs[index]` again (its last process has exited)."""
        self.processes[index] = self._popen(index)
        return self.processes[index]

    def _popen(self, index: int) -> subprocess.Popen:
        spec = self.specs[index]
        args = [sys.executable, "-m", "wicore.cli.main", "worker", "--settings-file", str(self.settings_file)]
        args += [*self.worker_args, *spec.args, "--name", spec.name]
        env = {**self.env, **dict(spec.env)}
        if self.log_dir is not None:
            with open(self.logs[index], "ab") as sink:
                return self.group.popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env)
        process = self.group.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.relays[index] = Relay(spec.name, process.stdout)
        self.relays[index].start()
        return process

    def last_error(self, index: int, *, any_line: bool = True) -> str | None:
        """What the worker of `specs[index]` said last: its one-line error ('error: ...'), else
        (with `any_line`) its last line."""
        relay = self.relays[index]
        if relay is None:
            return last_error(read_lines(self.logs[index]) if self.logs else [], any_line=any_line)
        relay.join(timeout=RELAY_DRAIN_S)  # a worker's last line may still be in the pipe
        return last_error(list(relay.tail), any_line=any_line)

    def check(self) -> None:
        """Raise when no worker is left alive, with the first one's own last words."""
        if any(p.poll() is None for p in self.processes):
            return
        code = self.processes[0].returncode
        reason = self.last_error(0) or f"exit status {code}"
        where = f" (log: {self.logs[0]})" if self.logs else ""
        exit_code = code if code in (ExitCode.USAGE, ExitCode.REDIS) else ExitCode.WORKERS
        raise WorkersDied(f"the workers exited before the work was done: {reason}{where}", exit_code)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.shut_down(warm=exc_type is None)
        finally:
            if self.settings_dir is not None:
                shutil.rmtree(self.settings_dir, ignore_errors=True)

    def shut_down(self, warm: bool) -> None:
        if warm:
            self.stop(signal.SIGTERM, WARM_STOP_S)
            return
        self.stop(signal.SIGTERM, 0.0)  # the first SIGTERM asks for a warm stop,
        time.sleep(0.2)  # (two signals before the handler runs would count as one)
        self.stop(signal.SIGTERM, COLD_STOP_S)  # the second for a cold one: claims go back at once

    def signal(self, sig: int) -> None:
        """Send `sig` to every live worker."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(sig)

    def stop(self, sig: int, wait_s: float) -> None:
        """Signal every live worker and wait up to `wait_s` in all; SIGKILL what is left after."""
        self.signal(sig)
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if wait_s > 0:
                    process.kill()
                    process.wait()


class Relay(threading.Thread):
    """A worker's output onto this process's stderr, each line under the worker's name, and its
    last lines kept. Its one-line error ('error: ...') is kept, not copied: whoever watches the
    worker reports it, in a line of its own."""

    def __init__(self, name: str, stream):
        super().__init__(name=f"wicore-relay-{name}", daemon=True)
        self.prefix = f"[{name}] "
        self.stream = stream
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    def run(self) -> None:
        with self.stream:
            for raw in self.stream:
                line = raw.decode(errors="replace").rstrip()
                self.tail.append(line)
                if line and not line.startswith("error: "):
                    self._copy(line)

    def _copy(self, line: str) -> None:
        # Our stderr may be gone (a closed terminal): keep draining, or the worker blocks on a full pipe.
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(self.prefix + line + "\n")


def read_lines(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()
    except OSError:
        return []


def last_error(lines: list[str], *, any_line: bool = True) -> str | None:
    """The worker's one-line error ('error: ...'), else (with `any_line`) its last non-empty line."""
    lines = [line.strip() for line in lines if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1].removeprefix("error: ")
    return lines[-1] if lines and any_line else None
