"""FLUSHALL under a live worker, with jobs submitted at once after it: the worker's first claim
and settle write a few fields of its record (state, counters) before its heartbeat looks, so the
record comes back partial. The heartbeat registers the worker again, whole, and it republishes
its model and engine: RQ's `Worker.all`, `wicore status --json` and the jobs submitted after the
wipe all see it again. A real `wicore worker` process (null engine) and a real redis-server.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
from redis import Redis
from rq.worker import Worker

from tests.fault_rig import Workers
from tests.helpers import png_bytes, wait_until, wicore
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, Submission
from wicore.schemas import GenerationParams

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

MODEL = "flush"
ARGS = ["--engine", "null", "--model-id", MODEL, "--batch-size", "8", "--max-queue-delay-ms", "0"]


def submit(producer: Producer, first: int, count: int) -> list[str]:
    params = GenerationParams(max_new_tokens=4)
    return producer.submit_many(
        Submission(png_bytes(i, (64, 48)), f"job {i}", params=params) for i in range(first, first + count)
    )


def finished(connection: Redis, ids: list[str]) -> bool:
    return all(connection.hget(f"rq:job:{job_id}", "status") == b"finished" for job_id in ids)


def listed(url: str, name: str) -> bool:
    """`wicore status --json` lists the worker with its model and engine."""
    report = json.loads(wicore("status", "--redis-url", url, "--json").stdout)
    return any(w["name"] == name and w["model"] == MODEL and w["engine"] == "null" for w in report["workers"])


def test_a_worker_registers_again_after_flushall(tmp_path):
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis())
        connection = Redis.from_url(server.url)
        env = {"WICORE_LIVENESS_TTL_S": "3", "WICORE_LOG_LEVEL": "INFO"}  # a heartbeat a second
        workers = stack.enter_context(Workers(server.url, tmp_path / "logs", ARGS, env))
        process = workers.start("f0")
        producer = Producer(connection, model=MODEL)
        before = submit(producer, 0, 8)
        wait_until(lambda: finished(connection, before), 60, what="the first jobs")
        wait_until(lambda: listed(server.url, "f0"), 30, what="f0 in wicore status")

        connection.flushall()
        after = submit(producer, 100, 8)
        wait_until(lambda: finished(connection, after), 60, what="the jobs submitted after FLUSHALL")

        def whole() -> bool:
            worker = {w.name: w for w in Worker.all(connection=connection)}.get("f0")
            return worker is not None and worker.pid == process.pid and worker.birth_date is not None

        wait_until(whole, 15, what="f0 registered again in RQ's records")
        wait_until(lambda: listed(server.url, "f0"), 15, what="f0 in wicore status again")
        assert workers.alive() == ["f0"]
        assert "registered again" in workers.log("f0")
        assert workers.stop_all() == {"f0": 0}
