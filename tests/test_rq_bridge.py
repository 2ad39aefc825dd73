"""Pins what wicore writes in RQ's own records against RQ's own readers. If an RQ upgrade
changes a key or a field these tests fail before users see a wrong dashboard."""

from __future__ import annotations

from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.worker import Worker

from wicore import keys
from wicore.worker.rq_bridge import Finished, RQBridge, RQWorkerRecord

QUEUE = "wicore.m.normal.c1.p64.n64"


def enqueue(conn, n, retries=None, notify=""):
    queue = Queue(QUEUE, connection=conn, serializer=JSONSerializer)
    data = [
        Queue.prepare_data(
            "wicore.worker.tasks.caption",
            args=[{"n": i}],
            job_id=f"job-{i}",
            retry=Retry(max=retries) if retries else None,
            meta={"notify": notify} if notify else None,
        )
        for i in range(n)
    ]
    return queue, queue.enqueue_many(data)


def bridge_for(conn, name="w1"):
    record = RQWorkerRecord([], name=name, connection=conn, serializer=JSONSerializer)
    record.register_birth()
    return RQBridge(record)


def test_claim_starts_jobs_as_rq_does(redis_conn):
    queue, _ = enqueue(redis_conn, 5)
    bridge = bridge_for(redis_conn)
    claimed = bridge.claim(QUEUE, 3)
    assert [c.id for c in claimed] == ["job-0", "job-1", "job-2"]
    assert claimed[0].args == [{"n": 0}] and claimed[0].origin == QUEUE
    assert queue.count == 2
    job = Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "w1" and job.started_at
    started = StartedJobRegistry(QUEUE, connection=redis_conn)
    assert sorted(started.get_job_ids()) == ["job-0", "job-1", "job-2"]
    worker = Worker.find_by_key(bridge.record.key, connection=redis_conn)
    assert worker.get_state() == "busy"
    assert {e.job_id for e in worker.get_current_executions()} == {"job-0", "job-1", "job-2"}
    assert redis_conn.lrange(bridge.claims_key, 0, -1) == [b"job-0", b"job-1", b"job-2"]


def test_finish_success_reads_back_through_rq(redis_conn):
    enqueue(redis_conn, 2, notify="wicore:notify:test")
    bridge = bridge_for(redis_conn)
    claimed = bridge.claim(QUEUE, 2)
    bridge.finish([Finished(c, result={"text": f"hello {c.id}"}) for c in claimed])
    job = Job.fetch("job-1", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED
    latest = job.latest_result()
    assert latest.type == Result.Type.SUCCESSFUL and latest.return_value == {"text": "hello job-1"}
    assert latest.worker_name == "w1" and latest.execution_id == claimed[1].execution_id
    assert job.return_value() == {"text": "hello job-1"}
    assert sorted(FinishedJobRegistry(QUEUE, connection=redis_conn).get_job_ids()) == ["job-0", "job-1"]
    assert StartedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == []
    assert 0 < redis_conn.ttl(job.key) <= 86_400
    worker = Worker.find_by_key(bridge.record.key, connection=redis_conn)
    assert worker.successful_job_count == 2 and worker.get_state() == "idle"
    assert worker.get_current_executions(refresh=True) == []
    assert redis_conn.llen(bridge.claims_key) == 0
    assert redis_conn.lrange("wicore:notify:test", 0, -1) == [b"job-0", b"job-1"]


def test_failure_without_retry_lands_in_failed_registry(redis_conn):
    enqueue(redis_conn, 1, retries=2)
    bridge = bridge_for(redis_conn)
    [claimed] = bridge.claim(QUEUE, 1)
    redis_conn.set(keys.submitted("job-0"), "x")
    bridge.finish([Finished(claimed, error="ImageError: not an image", retry=False)])
    job = Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED
    assert "ImageError: not an image" in job.latest_result().exc_string
    assert FailedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == ["job-0"]
    assert StartedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == []
    assert not redis_conn.exists(keys.submitted("job-0")), "a failed job may be resubmitted"
    assert Worker.find_by_key(bridge.record.key, connection=redis_conn).failed_job_count == 1


def test_transient_failure_is_retried_through_rq(redis_conn):
    queue, _ = enqueue(redis_conn, 1, retries=1)
    bridge = bridge_for(redis_conn)
    [claimed] = bridge.claim(QUEUE, 1)
    bridge.finish([Finished(claimed, error="EngineError: CUDA OOM", retry=True)])
    job = Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED and job.retries_left == 0
    assert queue.job_ids == ["job-0"]
    [again] = bridge.claim(QUEUE, 1)
    bridge.finish([Finished(again, error="EngineError: CUDA OOM", retry=True)])
    assert Job.fetch("job-0", connection=redis_conn).get_status() == JobStatus.FAILED, "retries spent"


def test_a_failure_of_a_job_canceled_while_it_ran_leaves_it_canceled(redis_conn):
    """The engine may fail a job in the step before its worker reads the cancel: no retry runs
    it again, and it is not counted as failed."""
    queue, _ = enqueue(redis_conn, 1, retries=2)
    bridge = bridge_for(redis_conn)
    [claimed] = bridge.claim(QUEUE, 1)
    Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer).cancel()
    bridge.finish([Finished(claimed, error="EngineError: CUDA OOM", retry=True)])
    job = Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.CANCELED and queue.count == 0
    assert FailedJobRegistry(QUEUE, connection=redis_conn).count == 0
    assert redis_conn.zcard("rq:executions:job-0") == 0 and redis_conn.llen(bridge.claims_key) == 0


def test_a_claim_drops_a_cancel_request_older_than_itself(redis_conn):
    """A cancel request left in the worker's set for an earlier run of the job (canceled, then
    submitted again) must not stop the new run."""
    enqueue(redis_conn, 2)
    bridge = bridge_for(redis_conn)
    redis_conn.sadd(keys.cancel("w1"), "job-0", "job-9")
    assert [c.id for c in bridge.claim(QUEUE, 2)] == ["job-0", "job-1"]
    assert redis_conn.smembers(keys.cancel("w1")) == {b"job-9"}


def test_requeue_claims_of_a_dead_worker(redis_conn):
    queue, _ = enqueue(redis_conn, 4, retries=1)
    dead = bridge_for(redis_conn, "dead")
    dead.claim(QUEUE, 3)  # started: job-0..2
    redis_conn.lpush(dead.claims_key, "job-3")  # claimed, never started (moved by hand)
    redis_conn.lrem("rq:queue:" + QUEUE, 1, "job-3")
    survivor = bridge_for(redis_conn, "alive")
    assert survivor.requeue_claims(dead.claims_key) == 4
    assert sorted(queue.job_ids) == ["job-0", "job-1", "job-2", "job-3"]
    assert queue.job_ids[0] == "job-3", "an unstarted job goes back to the head"
    assert StartedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == []
    assert Job.fetch("job-0", connection=redis_conn).retries_left == 0
    assert not redis_conn.exists(dead.claims_key)
    # requeueing twice never duplicates a queued job
    redis_conn.rpush(dead.claims_key, "job-3")
    survivor.requeue_claims(dead.claims_key)
    assert queue.job_ids.count("job-3") == 1
