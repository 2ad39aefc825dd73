"""Canceling jobs through RQ (`Producer.cancel`, `wicore cancel`) on a real redis-server: a
queued job never runs, a running one ends canceled while the rest of its batch finishes."""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import wait

import pytest
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, StartedJobRegistry

from tests.helpers import png_bytes, wait_until, wicore
from wicore.engines import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine
from wicore.errors import JobCanceled
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import GenerationParams
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL = "tiny"
LONG = GenerationParams(max_new_tokens=1000, ignore_eos=True)  # a thousand steps unless stopped
SHORT = GenerationParams(max_new_tokens=6)
MATES = GenerationParams(max_new_tokens=40, ignore_eos=True)  # still decoding when the cancel lands


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return ReferenceEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4))


def burst_worker(connection, engine, batch_size: int = 4) -> BatchingWorker:
    policy = BatchPolicy(max_batch_size=batch_size, max_queue_delay_s=0.0)
    return BatchingWorker(connection, engine, WorkerConfig(MODEL, policy=policy, burst=True))


def test_a_canceled_queued_job_never_runs(redis_conn, reference):
    producer = Producer(redis_conn, model=MODEL)
    ids = producer.submit_many([Submission(png_bytes(i), f"job {i}", params=SHORT) for i in range(3)])
    assert producer.cancel([ids[1]]) == {ids[1]: "canceled"}
    assert producer.cancel([ids[1]]) == {ids[1]: "canceled"}, "canceling twice is harmless"
    seen = reference.requests_seen
    worker = burst_worker(redis_conn, reference)
    worker.run()
    assert reference.requests_seen - seen == 2, "the canceled job never reached the engine"
    outcomes = {o.job_id: o for o in producer.wait(ids, timeout=10)}
    assert outcomes[ids[1]].status == "canceled" and outcomes[ids[1]].error.startswith("JobCanceled")
    assert all(outcomes[i].result is not None for i in (ids[0], ids[2]))
    with pytest.raises(JobCanceled):
        producer.result(ids[1])
    origin = Job.fetch(ids[1], connection=redis_conn).origin
    assert CanceledJobRegistry(origin, connection=redis_conn).get_job_ids() == [ids[1]]
    assert producer.cancel([ids[0], "no-such-job"]) == {ids[0]: "finished", "no-such-job": "missing"}

    again = producer.submit(png_bytes(1), "job 1", params=SHORT)
    assert again == ids[1]
    burst_worker(redis_conn, reference).run()
    assert producer.result(again, timeout=10).output_tokens == 6, "resubmitting canceled work runs it"


def test_the_claim_skips_a_canceled_job_still_in_its_queue(redis_conn, reference):
    """A cancel that lands while the job id sits in the queue (RQ removes it, but a requeue or
    another client may put it back): the worker's claim drops it unrun."""
    producer = Producer(redis_conn, model=MODEL)
    job_id = producer.submit(png_bytes(5), "x", params=SHORT)
    producer.cancel([job_id])
    origin = Job.fetch(job_id, connection=redis_conn).origin
    redis_conn.lpush(f"rq:queue:{origin}", job_id)
    seen = reference.requests_seen
    worker = burst_worker(redis_conn, reference)
    worker.run()
    assert reference.requests_seen == seen
    assert Job.fetch(job_id, connection=redis_conn).get_status() == JobStatus.CANCELED
    assert redis_conn.llen(f"rq:queue:{origin}") == 0 and redis_conn.zcard(f"wicore:claims:{worker.name}") == 0


def cancel_once_running(redis_url: str, job_id: str, engine, batch: int) -> threading.Thread:
    """From another thread (the worker runs in this one): cancel `job_id` once all `batch`
    requests have been handed to the engine (the long one is then decoding)."""
    from redis import Redis

    handed_over = engine.requests_seen + batch

    def run():
        wait_until(lambda: engine.requests_seen >= handed_over, 60, 0.002, "the batch in the engine")
        Producer(Redis.from_url(redis_url), model=MODEL).cancel([job_id])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_with_a_running_cancel(redis_url, redis_conn, engine):
    """Three jobs and a much longer one in one batch; the long one is canceled mid-run."""
    producer = Producer(redis_conn, model=MODEL)
    subs = [Submission(png_bytes(20 + i), "Describe this image.", params=MATES) for i in range(3)]
    ids = producer.submit_many(subs)
    doomed = producer.submit(png_bytes(30), "Describe this image.", params=LONG)
    thread = cancel_once_running(redis_url, doomed, engine, len(ids) + 1)
    worker = burst_worker(redis_conn, engine)
    worker.run()
    thread.join(timeout=60)
    return producer, subs, ids, doomed, worker


def test_a_running_job_ends_canceled_and_its_batch_mates_finish(redis_url, redis_conn, fast_engine, caplog):
    with caplog.at_level(logging.INFO, logger="wicore.worker.batches"):
        producer, subs, ids, doomed, worker = run_with_a_running_cancel(redis_url, redis_conn, fast_engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "wicore.worker.batches"]  # a claim per bucket
    [line] = [line for line in lines if "canceled" in line]
    assert len(lines) == 2 and re.fullmatch(r"batch \S+: 1 jobs \(1 canceled\) in \d+ ms, [\d.]+ tokens/s", line)
    assert not any("failed" in line for line in lines), "a cancel is no failure"
    outcomes = {o.job_id: o for o in producer.wait([*ids, doomed], timeout=10)}
    assert outcomes[doomed].status == "canceled" and outcomes[doomed].result is None
    assert redis_conn.xlen(f"rq:results:{doomed}") == 0, "no result is written for a canceled job"
    origin = Job.fetch(doomed, connection=redis_conn).origin
    assert StartedJobRegistry(origin, connection=redis_conn).count == 0
    assert CanceledJobRegistry(origin, connection=redis_conn).get_job_ids() == [doomed]
    assert redis_conn.scard(f"rq:worker:{worker.name}:executions") == 0
    assert redis_conn.zcard(f"rq:executions:{doomed}") == 0
    expected = fast_engine.generate([_request(job_id, sub) for job_id, sub in zip(ids, subs)])
    for job_id, want in zip(ids, expected):
        assert list(outcomes[job_id].result.token_ids) == want.token_ids, "batch mates are unaffected"


def test_a_canceled_sequence_stops_within_a_step(redis_url, redis_conn, fast_engine):
    run_with_a_running_cancel(redis_url, redis_conn, fast_engine)
    stats = fast_engine.stats()
    assert stats["decode_steps"] < LONG.max_new_tokens // 2, "the aborted sequence kept decoding"
    assert stats["kv_pages_used"] == 0 and fast_engine.num_unfinished() == 0


@pytest.fixture(scope="module")
def window_128(tmp_path_factory):
    """The tiny model with a sliding window longer than the prompts: every prompt block is cached."""
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


def test_a_deferred_abort_ends_its_job_canceled_from_a_later_step(redis_conn, window_128):
    """Three jobs on one image and prompt, behind another image in a one-image vision batch: after
    the first step the first of them has registered the prompt's blocks and the other two wait
    to read them, so `Engine.abort` stops it only once its prefill is launched, and a later
    `step` returns it. The worker keeps it in hand until then, and it still ends canceled: no
    result, no failure, no retry. The loop is driven step by step so that the cancel lands there."""
    options = FastOptions(block_size=4, vision_batch_size=1, torch_threads=1)
    engine = FastEngine(EngineConfig(str(window_128), max_batch_size=4, options=options))
    producer = Producer(redis_conn, model=MODEL)
    first = producer.submit(png_bytes(51), "Describe this image.", params=SHORT)
    same = [
        Submission(png_bytes(50), "Describe this image.", params=SHORT.model_copy(update={"seed": s}))
        for s in (1, 2, 3)
    ]
    doomed, *readers = producer.submit_many(same)
    worker = burst_worker(redis_conn, engine)
    worker._start()
    try:
        assert worker._admit() and [f.claimed.id for f in worker.in_flight.values()] == [first, doomed, *readers]
        runs = {flight.claimed.id: run for run, flight in worker.in_flight.items()}  # the engine's request ids
        wait([flight.loading for flight in worker.in_flight.values()])
        worker._hand_over_loaded()
        worker._collect(worker._step())
        assert {seq.id: seq for seq in engine.planner.sequences()}[runs[doomed]].cache.others_wait
        producer.cancel([doomed])
        worker._cancel()
        assert runs[doomed] in worker.in_flight, "the abort waits for its prefill"
        while worker.in_flight:
            worker._collect(worker._step())
    finally:
        worker._stop()
    outcomes = {o.job_id: o for o in producer.wait([first, doomed, *readers], timeout=10)}
    assert outcomes[doomed].status == "canceled" and redis_conn.xlen(f"rq:results:{doomed}") == 0
    origin = Job.fetch(doomed, connection=redis_conn).origin
    assert FailedJobRegistry(origin, connection=redis_conn).count == 0
    assert all(outcomes[job_id].result.output_tokens == 6 for job_id in (first, *readers))
    assert engine.stats()["aborted"] == 1 and engine.blocks.num_used == 0
    counts = {name: metric_sum(worker, f"wicore:request_{name}_total") for name in ("success", "failure", "canceled")}
    assert counts == {"success": 3, "failure": 0, "canceled": 1}


def metric_sum(worker: BatchingWorker, sample: str) -> float:
    return sum(s.value for metric in worker.metrics.registry.collect() for s in metric.samples if s.name == sample)


def _request(job_id, sub):
    from wicore.engines.base import EngineRequest
    from wicore.ops.image_decode import decode_image

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sub.prompt}]}]
    return EngineRequest(job_id, chat, [decode_image(sub.image)], sub.params, [])


def test_cancel_verb(redis_url, redis_conn):
    job_id = Producer(redis_conn, model=MODEL).submit(png_bytes(9), "x", params=SHORT)
    done = wicore("cancel", job_id, "wc-missing", "--redis-url", redis_url, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0] == {"job_id": job_id, "status": "canceled"}
    assert lines[1]["status"] is None and "no job wc-missing" in lines[1]["error"]
    assert done.returncode == 1
