"""Test data and small runners shared by the test modules."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from redis import Redis

from wicore import keys

# The console script pip installed beside this interpreter: the command users type.
WICORE = str(Path(sys.executable).with_name("wicore"))


def png_bytes(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A distinct, never-blank image per seed."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(1, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_images(folder: Path, count: int, start: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        path = folder / f"img{i:04d}.png"
        path.write_bytes(png_bytes(i, (24 + i % 40, 20 + (7 * i) % 50)))
        paths.append(path)
    return paths


def wicore(
    *args: str, env: dict | None = None, timeout: float = 300, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """Run the installed `wicore` command in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run([WICORE, *args], capture_output=True, text=True, env=full_env, timeout=timeout, input=stdin)
    if check and result.returncode != 0:
        raise AssertionError(f"wicore {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def without(module: str, *args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`wicore ARGS` in a Python where `module` cannot be imported, as if its extra were not
    installed (None in sys.modules: Python's own way to make an import fail)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\nfrom wicore.cli.main import main\nsys.argv[1:] = {args!r}\nmain()"
    )
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, cwd=cwd)  # fmt: skip


def start_cli(verb: str, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """A long-running `wicore <verb>` in a subprocess, its output into `log`."""
    sink = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [WICORE, verb, *args],
        env={**os.environ, **(env or {})},
        stdout=sink,
        stderr=subprocess.STDOUT,
    )


def start_worker(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    return start_cli("worker", *args, env=env, log=log)


def start_gateway(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """`wicore serve` in a subprocess; pair it with `wait_http` on its /health/live."""
    return start_cli("serve", *args, env=env, log=log)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus page parsed with prometheus_client's text parser: {(sample, labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200 (fails early if `process` exits)."""
    import urllib.request

    def answers() -> bool:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process serving {url} exited with {process.returncode}")
        try:
            return urllib.request.urlopen(url, timeout=2).status == 200
        except OSError:
            return False

    wait_until(answers, timeout, 0.1, f"{url} to answer")


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    return process.wait(timeout=timeout)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def at_a_frozen_moment(pids: list[int], held, act, timeout: float = 120):
    """Call `act()` at a moment the processes `pids` hold something, read while they are frozen
    (SIGSTOP): when `held()` is truthy it is read again a tenth of a second into the freeze, so a
    write sent just before lands first, and `act` runs only if it still is; they continue
    (SIGCONT) after each look, `act` included. Returns what `held()` read last."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            if held():
                time.sleep(0.1)
                if seen := held():
                    act()
                    return seen
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # `act` may have killed it
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.003)
    raise AssertionError(f"processes {pids} never held anything within {timeout}s")


def claimed_jobs(connection: Redis, worker: str) -> list[str]:
    """The job ids of the runs `worker` holds (its claims set's members are job id:execution id)."""
    return [run.decode().split(":")[0] for run in connection.zrange(keys.claims(worker), 0, -1)]


def queued_ids(connection: Redis) -> set[str]:
    """The ids of the jobs waiting in every RQ queue of this Redis."""
    return {i.decode() for key in connection.scan_iter("rq:queue:*") for i in connection.lrange(key, 0, -1)}


def kill_holding_pid(pid: int, held, timeout: float = 120):
    """kill -9 process `pid` at a moment `held()` is truthy (`at_a_frozen_moment`). Returns what
    `held()` read."""
    return at_a_frozen_moment([pid], held, lambda: os.kill(pid, signal.SIGKILL), timeout)


def all_values(connection: Redis) -> list[bytes]:
    """Every stored value of every key (strings, hashes, lists, sets, zsets, streams)."""
    values: list[bytes] = []
    for key in connection.scan_iter(count=1000):
        kind = connection.type(key).decode()
        if kind == "string":
            values.append(connection.get(key))
        elif kind == "hash":
            values += list(connection.hgetall(key).values())
        elif kind == "list":
            values += connection.lrange(key, 0, -1)
        elif kind == "set":
            values += list(connection.smembers(key))
        elif kind == "zset":
            values += connection.zrange(key, 0, -1)
        elif kind == "stream":
            values += [v for _, fields in connection.xrange(key) for v in fields.values()]
    return values


def wait_for_port(port: int, timeout: float = 30, process: subprocess.Popen | None = None) -> None:
    """Until something accepts connections on 127.0.0.1:port (or `process` exits)."""
    import socket

    def listening() -> bool:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process exited {process.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_until(listening, timeout, what=f"port {port}")


def plant_job(connection: Redis, queue_name: str, job_id: str, template_id: str, **fields) -> str:
    """A hand-made job hash: `template_id`'s fields with `fields` on top (None deletes a field),
    pushed onto `queue_name`: what a buggy or hostile client could write."""
    record = {k.decode(): v for k, v in connection.hgetall(f"rq:job:{template_id}").items()}
    for name, value in fields.items():
        record.pop(name, None) if value is None else record.__setitem__(name, value)
    connection.delete(f"rq:job:{job_id}")
    if record:
        connection.hset(f"rq:job:{job_id}", mapping=record)
    connection.rpush(f"rq:queue:{queue_name}", job_id)
    return job_id


def payload_data(payload) -> bytes:
    """RQ's `data` field for a wicore job whose payload (args[0]) is `payload`, as given."""
    import json
    import zlib

    return zlib.compress(json.dumps(["wicore.worker.tasks.caption", None, [payload], {}]).encode())


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    table = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        table.append((int(stat.parent.name), state, int(ppid), int(pgrp)))
    return table


def process_group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in a process group."""
    return [pid for pid, state, _, pgrp in processes() if pgrp == pgid and state != "Z"]


def children_of(pid: int) -> list[int]:
    return [child for child, _, ppid, _ in processes() if ppid == pid]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    return any(p == pid and state != "Z" for p, state, _, _ in processes())


class CommandCount:
    """The commands a redis-server ran inside a `with` block, by name, from INFO commandstats: the
    commands Lua scripts run count one by one, the INFO calls made here do not. Counts, not
    timings, so the Redis budget can be pinned exactly."""

    def __init__(self, connection: Redis):
        self.connection = connection
        self.by_name: dict[str, int] = {}

    def _calls(self) -> dict[str, int]:
        stats = self.connection.info("commandstats")
        return {name.removeprefix("cmdstat_"): entry["calls"] for name, entry in stats.items()}

    def __enter__(self) -> CommandCount:
        self._before = self._calls()
        return self

    def __exit__(self, *exc) -> None:
        after = self._calls()
        delta = {name: calls - self._before.get(name, 0) for name, calls in after.items() if name != "info"}
        self.by_name = {name: calls for name, calls in delta.items() if calls}

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


def fp8_gpu() -> bool:
    """A CUDA GPU with e4m3 tensor cores and conversions (compute capability 8.9+) is visible."""
    import torch

    from wicore.ops.fp8 import unsupported_reason

    return torch.cuda.is_available() and unsupported_reason(torch.device("cuda")) is None


@dataclass(frozen=True)
class Served:
    url: str  # the gateway's
    redis_url: str
    worker: subprocess.Popen


@contextlib.contextmanager
def served_with_a_worker(logs: Path, batch_size: int = 4, worker_env: dict | None = None):
    """A `Served`: one embedded Redis, one CPU fast-engine worker (the bundled model) and a
    gateway on loopback, both ready; stopped (the worker killed) on the way out."""
    import httpx

    from wicore.embedded import EmbeddedRedis, free_port

    with EmbeddedRedis() as redis_server:
        metrics_port = free_port()
        worker = start_worker(
            "--redis-url", redis_server.url, "--engine", "fast", "--engine-option", "torch_threads=1",
            "--batch-size", str(batch_size), "--metrics-port", str(metrics_port), env=worker_env,
            log=logs / "worker.log",
        )  # fmt: skip
        port = free_port()
        gateway = start_gateway("--redis-url", redis_server.url, "--port", str(port), log=logs / "gateway.log")
        try:  # a failed start stops both too
            wait_http(f"http://127.0.0.1:{metrics_port}/metrics", 120, worker)
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health/live", 60, gateway)
            wait_until(lambda: httpx.get(url + "/health/ready").status_code == 200, 60, 0.2, "a ready gateway")
            yield Served(url, redis_server.url, worker)
        finally:
            stop(gateway)
            stop(worker, signal.SIGKILL)
