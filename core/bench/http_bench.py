"""`wicore bench http`: submitting through the gateway against the Python producer, on the same
jobs (same payloads, so the same job ids: Redis is flushed between the sides), in the same run
and on the same Redis. One side at a time:

- single: one job per call, one after another (`producer.submit` / `POST /v1/jobs` with the
  image in base64, over one keep-alive connection): jobs/s and the p50/p99 latency of a submit;
- bulk: the same jobs in chunks (`producer.submit_many` / `POST /v1/jobs/batch`): jobs/s.

After each side a burst worker with the `null` engine drains the queue, and every job must
have finished: the jobs submitted either way are the same, complete jobs."""

from __future__ import annotations

import base64
import http.client
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis

from wicore.bench.plots import write_report
from wicore.bench.queue_bench import tiny_png
from wicore.embedded import free_port
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL_ID = "bench-http"
CHUNK = 256  # jobs per submit_many chunk and per batch request


@dataclass
class SideStats:
    latencies: list[float]  # seconds per single submit
    single_s: float
    bulk_s: float
    jobs: int

    def as_dict(self, prefix: str) -> dict:
        ordered = sorted(self.latencies)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {
            f"{prefix}_jobs_per_s": round(self.jobs / self.single_s, 1),
            f"{prefix}_p50_ms": round(1e3 * pick(0.50), 3),
            f"{prefix}_p99_ms": round(1e3 * pick(0.99), 3),
            f"{prefix}_bulk_jobs_per_s": round(self.jobs / self.bulk_s, 1),
        }


def submissions(jobs: int) -> list[Submission]:
    image = tiny_png()
    return [Submission(image, f"bench job {i}") for i in range(jobs)]


def drain(connection: Redis, jobs: int) -> None:
    """Run every queued job on a null-engine worker; all of them must finish."""
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=256))
    policy = BatchPolicy(max_batch_size=256, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL_ID, policy=policy, burst=True))
    worker.run()
    finished = sum(1 for key in connection.scan_iter("rq:job:*") if connection.hget(key, "status") == b"finished")
    if finished != jobs:
        raise RuntimeError(f"{finished} of {jobs} jobs finished after the drain")


def timed(calls) -> tuple[list[float], float]:
    latencies, start = [], time.perf_counter()
    for call in calls:
        begin = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - begin)
    return latencies, time.perf_counter() - start


def bench_producer(connection: Redis, subs: list[Submission]) -> SideStats:
    producer = Producer(connection, model=MODEL_ID)
    latencies, single_s = timed(lambda s=s: producer.submit(s.image, s.prompt) for s in subs)
    drain(connection, len(subs))
    connection.flushdb()
    start = time.perf_counter()
    producer.submit_many(subs, chunk=CHUNK)
    bulk_s = time.perf_counter() - start
    drain(connection, len(subs))
    return SideStats(latencies, single_s, bulk_s, len(subs))


class GatewayClient:
    """One keep-alive HTTP/1.1 connection to a gateway (the client's own cost stays small)."""

    def __init__(self, port: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: bytes, content_type: str = "application/json") -> dict:
        self.connection.request("POST", path, body=body, headers={"Content-Type": content_type})
        reply = self.connection.getresponse()
        data = reply.read()
        if reply.status != 202:
            raise RuntimeError(f"POST {path} answered {reply.status}: {data[:200]!r}")
        return json.loads(data)


def job_body(sub: Submission) -> dict:
    return {"image": base64.b64encode(sub.image).decode(), "prompt": sub.prompt}


def bench_gateway(connection: Redis, subs: list[Submission], port: int) -> SideStats:
    client = GatewayClient(port)
    bodies = [json.dumps(job_body(s)).encode() for s in subs]  # encoded up front: the client's share is not timed
    latencies, single_s = timed(lambda b=b: client.post("/v1/jobs", b) for b in bodies)
    drain(connection, len(subs))
    connection.flushdb()
    chunks = [json.dumps([job_body(s) for s in subs[i : i + CHUNK]]).encode() for i in range(0, len(subs), CHUNK)]
    start = time.perf_counter()
    for chunk in chunks:
        client.post("/v1/jobs/batch", chunk)
    bulk_s = time.perf_counter() - start
    drain(connection, len(subs))
    return SideStats(latencies, single_s, bulk_s, len(subs))


def start_gateway(redis_url: str, port: int) -> subprocess.Popen:
    args = ["serve", "--redis-url", redis_url, "--port", str(port), "--model-id", MODEL_ID]
    process = subprocess.Popen(
        [sys.executable, "-m", "wicore.cli.main", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            probe = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            probe.request("GET", "/health/live")
            if probe.getresponse().status == 200:
                return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the gateway did not start within 60 s")


def server_stack() -> str:
    """uvicorn's event loop as installed (uvloop when present) and its HTTP parser: h11 always,
    under the gateway's read deadlines (`wicore.gateway.server`)."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn ({loop}, h11)"


def run_bench(redis_url: str, jobs: int) -> dict:
    connection = Redis.from_url(redis_url)
    subs = submissions(jobs)
    connection.flushdb()
    producer = bench_producer(connection, subs)
    connection.flushdb()
    port = free_port()
    gateway_process = start_gateway(redis_url, port)
    try:
        gateway = bench_gateway(connection, subs, port)
    finally:
        gateway_process.terminate()
        gateway_process.wait(timeout=30)
    connection.flushdb()
    report = {
        "command": f"wicore bench http --jobs {jobs}",
        "cpus": os.cpu_count(),
        "jobs": jobs,
        "server": server_stack(),
        **producer.as_dict("producer"),
        **gateway.as_dict("gateway"),
    }
    report["latency_ratio_p50"] = round(report["gateway_p50_ms"] / report["producer_p50_ms"], 2)
    report["jobs_per_s_ratio"] = round(report["producer_jobs_per_s"] / report["gateway_jobs_per_s"], 2)
    report["bulk_jobs_per_s_ratio"] = round(report["producer_bulk_jobs_per_s"] / report["gateway_bulk_jobs_per_s"], 2)
    return report


def write_results(report: dict, folder: Path) -> list[Path]:
    bars = {
        "producer\none by one": report["producer_jobs_per_s"],
        "gateway\none by one": report["gateway_jobs_per_s"],
        "producer\nsubmit_many": report["producer_bulk_jobs_per_s"],
        "gateway\n/v1/jobs/batch": report["gateway_bulk_jobs_per_s"],
    }
    title = (
        f"{report['jobs']} submits, the gateway's cost over the producer's:\n"
        f"{report['jobs_per_s_ratio']:.1f}x one by one, {report['bulk_jobs_per_s_ratio']:.1f}x in bulk"
    )
    return write_report(report, folder / f"http-{os.cpu_count()}cpu", title, bars, "jobs / s")
