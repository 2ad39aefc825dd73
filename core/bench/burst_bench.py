"""`wicore bench burst`: the gateway under a burst of chat completions `factor` times what its
workers finish per second, with admission control and without, in the same run on the same Redis.

First the workers' rate R is measured (jobs submitted at once, drained by the running worker).
Then each side sends chat completions open-loop at factor x R for `seconds` (each request waits
for its caption, as a chat client does) and records every answer's status and latency:

- capped: `max_queued_jobs` = R x `wait_s`; past it the gateway answers 429 with Retry-After at
  once, so an accepted request waits at most about `wait_s` and the p99 stays bounded;
- uncapped: every request is queued, and the last ones wait for the whole burst to drain.

The worker is real (`wicore worker`, the reference engine on the bundled demo captioner), and
so are the gateway (`wicore serve`) and Redis."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis import Redis

from wicore.bench.queue_bench import tiny_png
from wicore.embedded import free_port
from wicore.producer import Producer, Submission

MODEL_ID = "bench-burst"
MAX_TOKENS = 8


@dataclass
class Side:
    name: str
    cap: int  # max_queued_jobs (0: none)
    latencies: list[float] = field(default_factory=list)  # seconds, accepted requests
    refused: list[float] = field(default_factory=list)  # seconds to the 429
    other: dict[int | str, int] = field(default_factory=dict)  # any other status (or transport error) -> count
    retry_after: set[str] = field(default_factory=set)

    def as_dict(self) -> dict:
        return {
            "cap": self.cap,
            "accepted": len(self.latencies),
            "refused_429": len(self.refused),
            "other_statuses": self.other,
            "p50_s": quantile(self.latencies, 0.5),
            "p99_s": quantile(self.latencies, 0.99),
            "max_s": round(max(self.latencies, default=0.0), 3),
            "refusal_p99_ms": round(1e3 * quantile(self.refused, 0.99), 1),
            "retry_after_s": sorted(self.retry_after, key=int),
        }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else 0.0


def start(verb: str, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    sink = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "-m", "wicore.cli.main", verb, *args], stdout=sink,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})  # fmt: skip


def wait_ready(url: str, path: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}{path} not ready within {timeout}s")


def worker_rate(redis_url: str, jobs: int) -> float:
    """Jobs per second the running worker finishes, from `jobs` submitted at once."""
    producer = Producer(redis_url, model=MODEL_ID)
    image = tiny_png()
    start_s = time.perf_counter()
    ids = producer.submit_many([Submission(image, f"rate {i}") for i in range(jobs)])
    for _ in producer.wait(ids, timeout=600):
        pass
    return jobs / (time.perf_counter() - start_s)


def chat_body(i: int) -> dict:
    image = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
    parts = [{"type": "text", "text": f"burst {i}"}, {"type": "image_url", "image_url": {"url": image}}]
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS}


async def burst(url: str, side: Side, rate: float, seconds: float) -> None:
    """Open-loop arrivals at `rate` per second for `seconds`; every answer recorded in `side`."""
    # a connection per request: a kept-alive one the gateway closes as it is reused would be a
    # client-side error, not the gateway's answer
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(i: int) -> None:
            begin = time.perf_counter()
            try:
                reply = await http.post("/v1/chat/completions", json=chat_body(i))
            except httpx.TransportError as exc:  # counted, not raised: every request gets a line
                side.other[type(exc).__name__] = side.other.get(type(exc).__name__, 0) + 1
                return
            took = time.perf_counter() - begin
            if reply.status_code == 200:
                side.latencies.append(took)
            elif reply.status_code == 429:
                side.refused.append(took)
                side.retry_after.add(reply.headers.get("Retry-After", "?"))
            else:
                side.other[reply.status_code] = side.other.get(reply.status_code, 0) + 1

        tasks, begin, count = [], time.perf_counter(), int(rate * seconds)
        for i in range(count):
            await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)


def run_side(redis_url: str, side: Side, rate: float, seconds: float, folder: Path) -> dict:
    Redis.from_url(redis_url).delete(*Redis.from_url(redis_url).keys("wicore:submitted:*") or ["-"])
    port = free_port()
    env = {"WICORE_MAX_QUEUED_JOBS": str(side.cap), "WICORE_REQUEST_TIMEOUT_S": "600"}
    gateway = start("serve", "--redis-url", redis_url, "--port", str(port), "--model-id", MODEL_ID, env=env,
                    log=folder / f"gateway-{side.name}.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, "/health/ready")
        asyncio.run(burst(url, side, rate, seconds))
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)
    return side.as_dict()


def run_bench(redis_url: str, factor: float, seconds: float, wait_s: float, folder: Path, rate_jobs: int = 200) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    worker = start("worker", "--redis-url", redis_url, "--engine", "reference", "--model-id", MODEL_ID,
                   "--max-queue-delay-ms", "5", log=folder / "worker.log")  # fmt: skip
    try:
        wait_worker(redis_url)
        rate = worker_rate(redis_url, rate_jobs)
        capped = Side("capped", cap=max(1, int(rate * wait_s)))
        uncapped = Side("uncapped", cap=0)
        sides = {s.name: run_side(redis_url, s, factor * rate, seconds, folder) for s in (capped, uncapped)}
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    return {
        "command": f"wicore bench burst --factor {factor:g} --seconds {seconds:g} --wait-s {wait_s:g} "
        f"--rate-jobs {rate_jobs}",
        "cpus": os.cpu_count(),
        "engine": "reference (bundled demo captioner, CPU)",
        "max_tokens": MAX_TOKENS,
        "worker_jobs_per_s": round(rate, 1),
        "burst_requests_per_s": round(factor * rate, 1),
        "burst_seconds": seconds,
        **{f"{name}_{key}": value for name, side in sides.items() for key, value in side.items()},
    }


def wait_worker(redis_url: str, timeout: float = 300) -> None:
    from wicore.worker.status import served_models

    connection = Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while MODEL_ID not in served_models(connection):
        if time.monotonic() > deadline:
            raise RuntimeError("the worker did not start")
        time.sleep(0.5)


def write_results(report: dict, folder: Path) -> list[Path]:
    from wicore.bench.plots import write_report

    bars = {
        "capped p50": report["capped_p50_s"],
        "capped p99": report["capped_p99_s"],
        "uncapped p50": report["uncapped_p50_s"],
        "uncapped p99": report["uncapped_p99_s"],
    }
    title = (
        f"chat completions, a burst {report['burst_requests_per_s'] / report['worker_jobs_per_s']:.0f}x the workers' "
        f"rate\ncapped: {report['capped_refused_429']} answered 429 at once, the rest within the cap"
    )
    return write_report(report, folder / f"burst-{os.cpu_count()}cpu", title, bars, "seconds to the answer")
