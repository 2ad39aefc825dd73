"""Interactive jobs beside bulk work, on a real redis-server and the tiny Gemma-3 (fast engine,
CPU): a high-lane job submitted while bulk jobs fill the worker's running set is taken at once
(the slots the policy keeps for the high lane) and ends before the bulk jobs already running (the
engine runs the leading lane alone; the worker steps no other lane's work while its image loads)."""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future

from rq.job import Job

from tests.helpers import png_bytes, wait_until
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import CaptionJob, GenerationParams, ImageRef, Lane
from wicore.worker.loop import BatchingWorker
from wicore.worker.rq_bridge import Claimed
from wicore.worker.worker_config import InFlight, WorkerConfig, overtaking_loads

MODEL = "tiny"
LONG = GenerationParams(max_new_tokens=300, ignore_eos=True)  # hundreds of steps: still running when it lands


def submit_once_running(producer: Producer, engine, running: int, submission: Submission) -> list[str]:
    """From another thread (the worker runs in this one): submit once `running` requests have
    reached the engine. The list gets the job's id."""
    submitted: list[str] = []

    def run():
        wait_until(lambda: engine.requests_seen >= running, 60, 0.002, "bulk jobs in the engine")
        submitted.append(producer.submit_many([submission])[0])

    threading.Thread(target=run, daemon=True).start()
    return submitted


def test_a_high_lane_job_overtakes_a_full_running_set(redis_conn, fast_engine):
    producer = Producer(redis_conn, model=MODEL)
    high = Submission(png_bytes(99), "interactive", params=LONG, priority=Lane.HIGH)
    # The high lane's queue exists already (a worker looks for new queues once a second).
    producer.cancel(producer.submit_many([Submission(png_bytes(98), "interactive", params=LONG, priority=Lane.HIGH)]))
    bulk = producer.submit_many([Submission(png_bytes(i), f"bulk {i}", params=LONG) for i in range(6)])
    submitted = submit_once_running(producer, fast_engine, 3, high)
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0, high_lane_slots=1)
    BatchingWorker(redis_conn, fast_engine, WorkerConfig(MODEL, policy=policy, burst=True)).run()
    [high_id] = submitted
    arrived = Job.fetch(high_id, connection=redis_conn).enqueued_at
    running = [i for i in bulk if Job.fetch(i, connection=redis_conn).started_at < arrived]
    assert len(running) == 3, "a full running set: every slot but the high lane's"
    ended = [raw.decode() for raw in redis_conn.lrange(producer.notify_key, 0, -1)]  # in completion order
    after = ended[ended.index(high_id) + 1 :]
    assert set(running) <= set(after), f"bulk jobs running when it arrived ended first: {ended}"
    assert all(producer.outcome(i).result.output_tokens == 300 for i in [*bulk, high_id])
    assert fast_engine.requests_seen == 7
    timeline = fast_engine.stats()["high_lane_timelines"][-1]  # seconds from `add` to each milestone
    milestones = ["vision", "vision_launched", "prefill", "decode", "first_token", "finished"]
    assert [timeline[m] for m in milestones] == sorted(timeline[m] for m in milestones)


def test_bulk_alone_never_takes_the_high_lanes_slots(redis_conn, fast_engine, caplog):
    producer = Producer(redis_conn, model=MODEL)
    short = GenerationParams(max_new_tokens=2)
    producer.submit_many([Submission(png_bytes(i), f"bulk {i}", params=short) for i in range(7)])
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0, high_lane_slots=1)
    with caplog.at_level(logging.INFO, logger="wicore.worker.batches"):
        worker = BatchingWorker(redis_conn, fast_engine, WorkerConfig(MODEL, policy=policy, burst=True))
        worker.run()
    claims = [int(re.search(r": (\d+) jobs", r.getMessage())[1]) for r in caplog.records if "jobs in" in r.getMessage()]
    assert worker.jobs_done == 7 and sum(claims) == 7 and max(claims) == 3, claims


def test_a_high_lane_job_past_its_deadline_still_fails_unrun(redis_conn, fast_engine):
    producer = Producer(redis_conn, model=MODEL)
    late = producer.submit(png_bytes(1), "late", priority=Lane.HIGH, deadline=time.time() - 1)
    on_time = producer.submit(png_bytes(2), "on time", priority=Lane.HIGH, params=GenerationParams(max_new_tokens=2))
    seen = fast_engine.requests_seen
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0, high_lane_slots=1)
    BatchingWorker(redis_conn, fast_engine, WorkerConfig(MODEL, policy=policy, burst=True)).run()
    outcomes = {o.job_id: o for o in producer.wait([late, on_time], timeout=30)}
    assert outcomes[late].error.startswith("DeadlineExceeded") and outcomes[on_time].result is not None
    assert fast_engine.requests_seen - seen == 1, "the late job never reached the engine"


def flight(rid: str, lane: Lane, loading: Future | None) -> InFlight:
    job = CaptionJob(image=ImageRef(sha256="a" * 64), model=MODEL, prompt=rid, priority=lane)
    return InFlight(Claimed(rid, "e", "q", [], {}, None, 0.0), job, batch=0, fetched=True, loading=loading)


def test_only_a_better_lane_loading_holds_the_engine_back():
    in_engine, loading = flight("bulk", Lane.NORMAL, None), Future()
    high, low = flight("high", Lane.HIGH, loading), flight("low", Lane.LOW, loading)
    assert overtaking_loads([in_engine, high, low]) == [high]
    assert overtaking_loads([high, low]) == [], "nothing in the engine to hold back"
    assert overtaking_loads([flight("bulk-2", Lane.NORMAL, loading), in_engine]) == []
