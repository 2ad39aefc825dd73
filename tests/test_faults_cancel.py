"""Cancel a running job, then submit the same work again while the canceled run is still in its
worker: the new run runs and finishes with its own result, and the old run's end touches only
its own records (no failure of the new job, no entry left in RQ's started registry).

A real `wicore worker` (the tiny model on the fast engine, CPU) and a real redis-server; the
worker is frozen (SIGSTOP) from before the cancel until after the resubmission, so it reads the
cancel only once the new job is queued. Through the Producer, and through a real gateway
(DELETE, POST the same body, GET ?wait).
"""

from __future__ import annotations

import base64
import signal
from contextlib import ExitStack

import httpx
import pytest
from redis import Redis
from rq.job import Job

from tests.fault_rig import Workers
from tests.helpers import at_a_frozen_moment, claimed_jobs, png_bytes, start_gateway, stop, wait_http, wait_until
from wicore import keys
from wicore.embedded import EmbeddedRedis, free_port
from wicore.producer import Producer
from wicore.schemas import GenerationParams

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

MODEL = "tiny"
LONG = GenerationParams(max_new_tokens=160, ignore_eos=True)  # a run of a second or more
ROUNDS = 4


@pytest.fixture
def rig(tmp_path, tiny_model_dir):
    """(Redis URL, a running worker `c0`, a connection)."""
    args = ["--model", str(tiny_model_dir), "--model-id", MODEL, "--engine", "fast", "--device", "cpu"]
    args += ["--engine-option", "torch_threads=1", "--batch-size", "4", "--max-queue-delay-ms", "0"]
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis())
        workers = stack.enter_context(Workers(server.url, tmp_path / "logs", args, {"WICORE_LOG_LEVEL": "INFO"}))
        workers.start("c0")
        yield server.url, workers, Redis.from_url(server.url)


def resubmit_while_running(connection: Redis, workers: Workers, job_id: str, cancel, resubmit) -> None:
    """Freeze the worker while it runs `job_id`, cancel and resubmit it, let the worker go on."""
    wait_until(lambda: job_id in claimed_jobs(connection, "c0"), 60, what=f"the worker to start {job_id}")
    pid = workers.processes["c0"].pid

    def act() -> None:
        assert cancel() == "canceled"
        assert resubmit() == job_id, "same work, same id"

    at_a_frozen_moment([pid], lambda: job_id in claimed_jobs(connection, "c0"), act, timeout=60)


def assert_new_run_finished(connection: Redis, job_id: str) -> None:
    job = Job.fetch(job_id, connection=connection)
    [(_, fields)] = connection.xrange(f"rq:results:{job_id}")
    assert int(fields[b"type"]) == 1, f"{job_id}: {fields}"
    assert fields[b"execution_id"].decode() == connection.hget(job.key, keys.RUN_FIELD).decode()


def assert_no_run_left(connection: Redis, workers: Workers) -> None:
    wait_until(lambda: connection.zcard(keys.claims("c0")) == 0, 30, what="the worker to hold nothing")
    queues = [q.decode()[len("rq:queue:") :] for q in connection.smembers("rq:queues")]
    assert all(connection.zcard(f"rq:wip:{q}") == 0 for q in queues), "a run left in RQ's started registry"
    assert connection.scard("rq:worker:c0:executions") == 0
    assert workers.alive() == ["c0"]


def test_cancel_then_resubmit_through_the_producer_runs_the_new_job(rig):
    url, workers, connection = rig
    producer = Producer(url, model=MODEL)
    image = png_bytes(7, (64, 48))
    for i in range(ROUNDS):
        job_id = producer.submit(image, f"round {i}", params=LONG)
        resubmit_while_running(
            connection,
            workers,
            job_id,
            cancel=lambda j=job_id: producer.cancel([j])[j],
            resubmit=lambda i=i: producer.submit(image, f"round {i}", params=LONG),
        )
        outcome = producer.outcome(job_id, timeout=120)
        assert outcome.status == "finished" and outcome.result is not None, (outcome, workers.log("c0")[-3000:])
        assert_new_run_finished(connection, job_id)
    assert_no_run_left(connection, workers)


def test_cancel_then_resubmit_through_the_gateway_runs_the_new_job(rig, tmp_path):
    url, workers, connection = rig
    port = free_port()
    gateway = start_gateway("--redis-url", url, "--port", str(port), "--model-id", MODEL, log=tmp_path / "gw.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health/live", 60, gateway)
        body = {
            "image": base64.b64encode(png_bytes(8, (64, 48))).decode(),
            "prompt": "again",
            "params": LONG.model_dump(),
        }
        with httpx.Client(base_url=base, timeout=120) as client:
            reply = client.post("/v1/jobs", json=body)
            assert reply.status_code == 202, reply.text
            job_id = reply.json()["job_id"]
            resubmit_while_running(
                connection,
                workers,
                job_id,
                cancel=lambda: client.delete(f"/v1/jobs/{job_id}").json()["status"],
                resubmit=lambda: client.post("/v1/jobs", json=body).json()["job_id"],
            )
            done = client.get(f"/v1/jobs/{job_id}", params={"wait": 60}).json()
        assert done["status"] == "finished" and done["error"] is None, done
        assert_new_run_finished(connection, job_id)
        assert_no_run_left(connection, workers)
    finally:
        stop(gateway, signal.SIGTERM)
