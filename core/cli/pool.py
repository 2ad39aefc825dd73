"""Worker processes that `wicore caption` starts and stops around its own run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from wicore.config import Settings, write_settings_file
from wicore.errors import WicoreError


class WorkersDied(WicoreError):
    """Every worker process exited before the work was done."""


class WorkerPool:
    """`count` x `wicore worker` subprocesses (each loads the model once; none forks). Each gets
    `settings` in a file of its own folder; the WICORE_ variables of this process are not passed
    on, so a worker runs with exactly the settings it was given."""

    def __init__(self, count: int, settings: Settings, log_dir: Path):
        self.count = count
        self.settings = settings
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.settings_dir: Path | None = None

    def __enter__(self) -> WorkerPool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.settings_dir = Path(tempfile.mkdtemp(prefix="wicore-settings-"))  # mode 0700
        settings_file = write_settings_file(self.settings, self.settings_dir)
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("WICORE_")}
        for i in range(self.count):
            log = self.log_dir / f"worker-{os.getpid()}-{i}.log"
            args = [sys.executable, "-m", "wicore.cli.main", "worker", "--settings-file", str(settings_file)]
            args += ["--name", f"caption-{os.getpid()}-{i}"]
            with open(log, "wb") as sink:
                self.processes.append(subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env))
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
        if self.settings_dir is not None:
            shutil.rmtree(self.settings_dir, ignore_errors=True)
