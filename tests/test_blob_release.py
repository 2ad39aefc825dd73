"""Blobs leave Redis with the last job that uses them (`ProducerConfig.release_blobs`): a blob's
users are a set of job ids (`keys.BLOB_USERS`), so a job ended twice (a run settled twice, a
cancel and then its worker's end, a stale run of a job requeued by a reaper) frees nothing twice,
and a blob another unfinished job needs is never deleted. In-process on RQBridge's scripts, then
with real `wicore worker` processes killed (-9) and frozen past their liveness TTL."""

from __future__ import annotations

import os
import signal
import time

import pytest
from redis import Redis
from rq.serializers import JSONSerializer

from tests.fault_rig import Workers, audit, wait_all_ended
from tests.helpers import CommandCount, claimed_jobs, png_bytes, wait_until
from wicore import keys
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.producer.claims import blob_shas
from wicore.scheduler.queues import BucketQueues
from wicore.schemas import GenerationParams
from wicore.worker.rq_bridge import Finished, RQBridge, RQWorkerRecord

MODEL = "release"
RELEASING = ProducerConfig(retries=3, release_blobs=True)
SHORT = GenerationParams(max_new_tokens=4)


@pytest.fixture
def connection():
    with EmbeddedRedis() as server, Redis.from_url(server.url) as conn:
        yield conn


def bridge_of(connection: Redis, name: str) -> RQBridge:
    record = RQWorkerRecord([], name=name, connection=connection, serializer=JSONSerializer)
    record.register_birth()
    return RQBridge(record)


def blob_state(connection: Redis, image: bytes) -> tuple[bool, set[str]]:
    """(is the blob stored, the ids of its users)."""
    job = Producer(connection, model=MODEL, config=RELEASING).prepare(Submission(image, "x")).job
    [sha] = blob_shas(job)
    users = {raw.decode() for raw in connection.smembers(keys.blob_users(sha))}
    return bool(connection.exists(keys.blob(sha))), users


def test_a_blob_outlives_double_settles_and_stale_runs_of_its_users(connection):
    producer = Producer(connection, model=MODEL, config=RELEASING)
    shared = png_bytes(1)
    first, second = producer.submit_many([Submission(shared, "a"), Submission(shared, "b")])
    assert blob_state(connection, shared) == (True, {first, second})
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = bridge_of(connection, "w1")
    claimed = {c.id: c for c in bridge.claim(queue, 2)}

    assert bridge.finish([Finished(claimed[first], result={"text": "ok"})]) == 1
    assert bridge.finish([Finished(claimed[first], result={"text": "again"})]) == 0, "a run settles once"
    assert blob_state(connection, shared) == (True, {second}), "the other user keeps the blob"

    assert bridge.requeue(bridge.claims_key, [claimed[second].run], died=True) == 1  # a reaper's requeue
    assert blob_state(connection, shared) == (True, {second}), "a requeued job still needs its blob"
    other = bridge_of(connection, "w2")
    retaken = other.claim(queue, 1)
    assert bridge.finish([Finished(claimed[second], result={"text": "stale"})]) == 0, "the lost run is not held"
    assert blob_state(connection, shared) == (True, {second})
    assert other.finish([Finished(retaken[0], result={"text": "ok"})]) == 1
    assert blob_state(connection, shared) == (False, set()), "the last user's end deletes the blob"


def test_a_failed_run_with_retries_keeps_its_blob_and_a_final_failure_frees_it(connection):
    producer = Producer(connection, model=MODEL, config=ProducerConfig(retries=1, release_blobs=True))
    image = png_bytes(2)
    producer.submit(image, "flaky")
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = bridge_of(connection, "w1")
    [run] = bridge.claim(queue, 1)
    assert bridge.finish([Finished(run, error="EngineError: busy", retry=True)]) == 1
    assert blob_state(connection, image)[0], "requeued for its retry: the blob stays"
    [run] = bridge.claim(queue, 1)
    assert bridge.finish([Finished(run, error="EngineError: busy", retry=True)]) == 1  # out of retries: failed
    assert blob_state(connection, image) == (False, set())


def test_cancel_frees_a_blob_of_no_other_user_and_the_canceled_run_frees_nothing_twice(connection):
    producer = Producer(connection, model=MODEL, config=RELEASING)
    alone, shared = png_bytes(3), png_bytes(4)
    queued_alone, running, waiting = producer.submit_many(
        [Submission(alone, "q"), Submission(shared, "r"), Submission(shared, "w")]
    )
    assert producer.cancel([queued_alone]) == {queued_alone: "canceled"}
    assert blob_state(connection, alone) == (False, set())
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = bridge_of(connection, "w1")
    claimed = {c.id: c for c in bridge.claim(queue, 2)}
    assert producer.cancel([running]) == {running: "canceled"}  # started: its worker stops it
    assert blob_state(connection, shared) == (True, {waiting})
    assert bridge.finish([Finished(claimed[running], error="canceled", canceled=True)]) == 1
    assert blob_state(connection, shared) == (True, {waiting}), "the canceled run's end frees nothing more"
    assert bridge.finish([Finished(claimed[waiting], result={"text": "ok"})]) == 1
    assert blob_state(connection, shared) == (False, set())


def settle_costs(connection: Redis, config: ProducerConfig, n: int, images: int) -> dict[str, int]:
    """Commands by name of one settle of n - 1 jobs over `images` distinct images."""
    connection.flushdb()
    Producer(connection, model=MODEL, config=config).submit_many(
        Submission(png_bytes(i % images), f"job {i}") for i in range(n)
    )
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = bridge_of(connection, "budget")
    claimed = bridge.claim(queue, n)
    bridge.finish([Finished(claimed[0], result={"text": "ok"})])  # loads the script (NOSCRIPT is no batch's cost)
    with CommandCount(connection) as settle:
        assert bridge.finish([Finished(c, result={"text": "ok"}) for c in claimed[1:]]) == n - 1
    return {**settle.by_name, "total": settle.total}


def test_release_costs_two_commands_per_distinct_blob_and_nothing_without(connection):
    n, images = 64, 4
    plain = settle_costs(connection, ProducerConfig(), n, images)
    releasing = settle_costs(connection, RELEASING, n, images)
    assert releasing["total"] == plain["total"] + 2 * images, (plain, releasing)
    assert releasing.get("srem", 0) - plain.get("srem", 0) == images, (plain, releasing)
    assert releasing.get("exists", 0) - plain.get("exists", 0) == images, (plain, releasing)
    assert not list(connection.scan_iter("wicore:blob*")), "every blob went with its last user"


LIVENESS_TTL_S = 3
ARGS = ["--engine", "null", "--model-id", MODEL, "--batch-size", "8", "--max-queue-delay-ms", "0"]


@pytest.mark.faults
@pytest.mark.timeout(600)
def test_killed_and_frozen_workers_never_free_a_blob_still_needed(tmp_path):
    """Many jobs over 4 shared ~1-megapixel images; some canceled (queued ones, and the ones a
    worker is running), a worker killed -9 holding jobs (restarted, it gives them back), another
    frozen past its liveness TTL holding jobs (the others' reapers requeue them; thawed, its runs
    are stale). Every job finishes, so no blob went while a job
    needed it; at the end no blob and no set of users is left."""
    with (
        EmbeddedRedis() as server,
        Workers(server.url, tmp_path / "logs", ARGS, {"WICORE_LIVENESS_TTL_S": "3"}) as workers,
    ):
        connection = Redis.from_url(server.url)
        for name in ("w0", "w1", "w2"):
            workers.start(name)
        producer = Producer(server.url, model=MODEL, config=ProducerConfig(retries=5, release_blobs=True))
        images = [png_bytes(10 + i, (1000, 1000)) for i in range(4)]
        ids = producer.submit_many(Submission(images[i % 4], f"job {i}", params=SHORT) for i in range(400))
        wait_until(lambda: claimed_jobs(connection, "w2"), 60, what="w2 to hold jobs")
        canceled = {i for i, status in producer.cancel(ids[::10] + claimed_jobs(connection, "w2")).items()
                    if status == "canceled"}  # fmt: skip
        ids = [i for i in ids if i not in canceled]
        workers.kill_holding("w0")
        workers.start("w0", wait=False)
        frozen = workers.processes["w1"].pid
        wait_until(lambda: claimed_jobs(connection, "w1"), 60, what="w1 to hold jobs")
        os.kill(frozen, signal.SIGSTOP)
        try:
            wait_until(lambda: not connection.exists("rq:worker:w1"), 30, what="w1's record to expire")
            wait_until(lambda: not claimed_jobs(connection, "w1"), 30, what="a reaper to requeue w1's jobs")
        finally:
            os.kill(frozen, signal.SIGCONT)
        wait_all_ended(connection, ids, timeout=300)
        queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
        statuses = audit(connection, ids, queues)
        ended_canceled = {connection.hget(f"rq:job:{i}", "status") for i in canceled}
        time.sleep(0.5)  # the last settles' deletes
        left = sorted(k.decode() for k in connection.scan_iter("wicore:blob*"))
    assert statuses == {"finished": len(set(ids))}, "every job finished: no blob went while a job needed it"
    assert canceled and ended_canceled == {b"canceled"}, "queued and running jobs canceled, sharing their blobs"
    assert left == [], left
