"""`wicore bench queue`: the queue path alone. The batching worker with the `null` engine
against plain RQ's SimpleWorker, on the same jobs (same payloads, same image blob, same
per-job work: validate, fetch the image, decode it, build the result), in the same run and on
the same Redis. Reports jobs/s, their ratio, and Redis commands and Redis CPU per job."""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from wicore.bench.plots import write_report
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL_ID = "bench-null"


@dataclass
class RunStats:
    jobs: int
    seconds: float
    commands: int
    redis_cpu_s: float

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds

    def as_dict(self, prefix: str) -> dict:
        return {
            f"{prefix}_jobs_per_s": round(self.jobs_per_s, 1),
            f"{prefix}_seconds": round(self.seconds, 3),
            **self.redis_cost(prefix),
        }

    def redis_cost(self, prefix: str) -> dict:
        return {
            f"{prefix}_commands_per_job": round(self.commands / self.jobs, 2),
            f"{prefix}_redis_cpu_us_per_job": round(1e6 * self.redis_cpu_s / self.jobs, 1),
        }


def tiny_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def redis_counters(connection: Redis) -> tuple[int, float]:
    stats, cpu = connection.info("stats"), connection.info("cpu")
    return int(stats["total_commands_processed"]), float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def measure(connection: Redis, jobs: int, run) -> RunStats:
    commands0, cpu0 = redis_counters(connection)
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    commands1, cpu1 = redis_counters(connection)
    return RunStats(jobs, seconds, commands1 - commands0, cpu1 - cpu0)


def bench_batching(connection: Redis, jobs: int, batch_size: int) -> tuple[RunStats, RunStats]:
    """(enqueueing the jobs, the worker's run)."""
    producer = Producer(connection, model=MODEL_ID, config=ProducerConfig(retries=1))
    image = tiny_png()
    enqueue = measure(
        connection, jobs, lambda: producer.submit_many(Submission(image, f"bench job {i}") for i in range(jobs))
    )
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=batch_size))
    policy = BatchPolicy(max_batch_size=batch_size, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL_ID, policy=policy, burst=True, max_jobs=jobs))
    return enqueue, measure(connection, jobs, worker.run)


def bench_plain_rq(connection: Redis, jobs: int) -> tuple[RunStats, RunStats]:
    """The same payloads as plain RQ jobs, run one by one by RQ's SimpleWorker."""
    producer = Producer(connection, model=MODEL_ID + "-rq", config=ProducerConfig(retries=1))
    image = tiny_png()
    payloads = [producer.prepare(Submission(image, f"bench job {i}")).job for i in range(jobs)]
    queue = Queue("bench-plain-rq", connection=connection, serializer=JSONSerializer)
    datas = [
        Queue.prepare_data("wicore.bench.rq_task.null_caption", args=[p.model_dump(mode="json")]) for p in payloads
    ]

    def enqueue() -> None:
        connection.set(f"wicore:blob:{payloads[0].images[0].sha256}", image)
        queue.enqueue_many(datas)

    enqueued = measure(connection, jobs, enqueue)
    worker = SimpleWorker([queue], connection=connection, serializer=JSONSerializer)
    return enqueued, measure(connection, jobs, lambda: worker.work(burst=True, logging_level="WARNING"))


def write_results(report: dict, folder: Path) -> list[Path]:
    bars = {
        f"wicore batching worker (batch {report['batch_size']})": report["batch_jobs_per_s"],
        "RQ SimpleWorker": report["rq_jobs_per_s"],
    }
    title = (
        f"{report['jobs']} jobs, null engine: {report['ratio']:.1f}x plain RQ\n"
        f"Redis a job: {report['batch_commands_per_job']:.1f} vs {report['rq_commands_per_job']:.1f} commands, "
        f"{report['batch_redis_cpu_us_per_job']:.0f} vs {report['rq_redis_cpu_us_per_job']:.0f} us CPU"
    )
    return write_report(report, folder / f"queue-{os.cpu_count()}cpu", title, bars, "jobs / s")


def run_bench(redis_url: str, jobs: int, batch_size: int) -> dict:
    connection = Redis.from_url(redis_url)
    connection.flushdb()
    batch_enqueue, batching = bench_batching(connection, jobs, batch_size)
    connection.flushdb()
    rq_enqueue, plain = bench_plain_rq(connection, jobs)
    connection.flushdb()
    return {
        "command": f"wicore bench queue --jobs {jobs} --batch-size {batch_size}",
        "cpus": os.cpu_count(),
        "jobs": jobs,
        "batch_size": batch_size,
        **batching.as_dict("batch"),
        **plain.as_dict("rq"),
        "ratio": round(batching.jobs_per_s / plain.jobs_per_s, 2),
        **batch_enqueue.redis_cost("batch_enqueue"),
        **rq_enqueue.redis_cost("rq_enqueue"),
    }
