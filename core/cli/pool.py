"""Worker processes that `wicore caption` starts and stops around its own run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wicore.cli.failures import ExitCode
from wicore.cli.process_group import ProcessGroup
from wicore.config import Settings, write_settings_file
from wicore.errors import WicoreError

WARM_STOP_S = 60.0  # a clean end: workers finish what they hold (nothing, normally) and exit
COLD_STOP_S = 10.0  # after a failure or a signal: claimed jobs go back to their queues, then SIGKILL


class WorkersDied(WicoreError):
    """Every worker process exited before the work was done."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class WorkerPool:
    """`count` x `wicore worker` subprocesses (each loads the model once; none forks), in the
    run's process group, each writing its log to `log_dir`. They get `settings` in a 0600 file of
    a private folder and none of this process's WICORE_ variables: a worker runs with exactly the
    settings it was given (and no password shows in its argv)."""

    def __init__(
        self, count: int, settings: Settings, worker_args: list[str], log_dir: Path, group: ProcessGroup, run_id: str
    ):
        self.settings = settings
        self.worker_args = worker_args
        self.log_dir = log_dir
        self.group = group
        self.names = [f"caption-{run_id}-{i}" for i in range(count)]
        self.processes: list[subprocess.Popen] = []
        self.settings_dir: Path | None = None

    @property
    def logs(self) -> list[Path]:
        return [self.log_dir / f"{name}.log" for name in self.names]

    def __enter__(self) -> WorkerPool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.settings_dir = Path(tempfile.mkdtemp(prefix="wicore-settings-"))  # mode 0700
        settings_file = write_settings_file(self.settings, self.settings_dir)
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WICORE_")}
        for name, log in zip(self.names, self.logs):
            args = [sys.executable, "-m", "wicore.cli.main", "worker", "--settings-file", str(settings_file)]
            args += [*self.worker_args, "--name", name]
            with open(log, "wb") as sink:
                self.processes.append(self.group.popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env))
        return self

    def check(self) -> None:
        """Raise when no worker is left alive, with the first one's own last words."""
        if any(p.poll() is None for p in self.processes):
            return
        code = self.processes[0].returncode
        reason = last_error(self.logs[0]) or f"exit status {code}"
        exit_code = code if code in (ExitCode.USAGE, ExitCode.REDIS) else ExitCode.WORKERS
        raise WorkersDied(f"the workers exited before the work was done: {reason} (log: {self.logs[0]})", exit_code)

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

    def stop(self, sig: int, wait_s: float) -> None:
        """Signal every live worker and wait up to `wait_s` in all; SIGKILL what is left after."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(sig)
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if wait_s > 0:
                    process.kill()
                    process.wait()


def last_error(log: Path) -> str | None:
    """The worker's one-line error ('error: ...'), else its last non-empty log line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1].removeprefix("error: ")
    return lines[-1] if lines else None
