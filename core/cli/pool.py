"""Worker processes that `wicore caption` starts and stops around its own run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from wicore.errors import WicoreError


class WorkersDied(WicoreError):
    """Every worker process exited before the work was done."""


class WorkerPool:
    """`count` x `wicore worker` subprocesses (each loads the model once; none forks)."""

    def __init__(self, count: int, worker_args: list[str], log_dir: Path):
        self.count = count
        self.worker_args = worker_args
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def __enter__(self) -> WorkerPool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.count):
            log = self.log_dir / f"worker-{os.getpid()}-{i}.log"
            args = [sys.executable, "-m", "wicore.cli.main", "worker", *self.worker_args]
            args += ["--name", f"caption-{os.getpid()}-{i}"]
            with open(log, "wb") as sink:
                self.processes.append(subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT))
            self.logs.append(log)
        return self

    def check(self) -> None:
        """Raise with the last log lines when no worker is left alive."""
        if any(p.poll() is None for p in self.processes):
            return
        tail = self.logs[0].read_text(errors="replace").strip().splitlines()[-15:]
        raise WorkersDied("all workers exited early; last lines of the first one's log:\n  " + "\n  ".join(tail))

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
