"""Pins what wicore writes in RQ's own records against RQ's own readers. If an RQ upgrade
changes a key or a field these tests fail before users see a wrong dashboard."""

from __future__ import annotations

import json
import zlib

import pytest
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.worker import Worker

from tests.helpers import png_bytes
from wicore import keys
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.scheduler.queues import BucketQueues
from wicore.worker.loop import BatchingWorker
from wicore.worker.rq_bridge import Finished, RQBridge, RQWorkerRecord
from wicore.worker.worker_config import WorkerConfig

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
    assert bridge.claimed_runs() == [c.run for c in claimed] == [f"job-{i}:{claimed[i].execution_id}" for i in range(3)]
    assert redis_conn.hget(job.key, keys.RUN_FIELD).decode() == claimed[0].execution_id, "the job's current run"
    [execution] = job.get_executions()
    assert execution.id == claimed[0].execution_id and execution.worker_name == "w1"
    for key in (execution.key, f"rq:executions:{job.id}", bridge.record.executions_key):
        assert redis_conn.ttl(key) > 0, f"{key} has no TTL"


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
    assert redis_conn.zcard(bridge.claims_key) == 0
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
    assert redis_conn.zcard("rq:executions:job-0") == 0 and redis_conn.zcard(bridge.claims_key) == 0


def resubmitted_while_running(redis_conn, second_worker: str):
    """A job canceled while worker w1 runs it, submitted again and claimed by `second_worker`:
    (producer, job id, queue, w1's bridge, the old run, the new run's bridge, the new run)."""
    producer = Producer(redis_conn, model="again")
    job_id = producer.submit(png_bytes(1), "again")
    [queue] = BucketQueues(redis_conn, "again").names()
    bridge = bridge_for(redis_conn)
    [old] = bridge.claim(queue, 1)
    assert producer.cancel([job_id]) == {job_id: "canceled"}
    assert redis_conn.smembers(keys.cancel("w1")) == {old.run.encode()}, "the cancel names the run it stops"
    assert producer.submit(png_bytes(1), "again") == job_id
    other = bridge if second_worker == "w1" else bridge_for(redis_conn, second_worker)
    [new] = other.claim(queue, 1)
    assert new.id == old.id == job_id and new.run != old.run
    return producer, job_id, queue, bridge, old, other, new


@pytest.mark.parametrize("second_worker", ["w1", "w2"])
def test_the_end_of_a_canceled_run_leaves_the_jobs_next_run_alone(redis_conn, second_worker):
    """Cancel, then submit the same work again while the canceled run is still in a worker: the
    old run's end (aborted, or finished before the abort) touches only its own records, and the
    new run ends as its own."""
    producer, job_id, queue, bridge, old, other, new = resubmitted_while_running(redis_conn, second_worker)
    assert bridge.finish([Finished(old, canceled=True), Finished(old, result={"text": "stale"})]) == 0
    assert Job.fetch(job_id, connection=redis_conn).get_status() == JobStatus.STARTED
    assert redis_conn.xlen(f"rq:results:{job_id}") == 0
    assert other.claimed_runs() == [new.run]
    assert other.finish([Finished(new, result={"text": "new"})]) == 1
    job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED and job.latest_result().return_value == {"text": "new"}
    assert redis_conn.zcard(f"rq:wip:{queue}") == 0, "no run left in RQ's started registry"
    for b in {bridge, other}:
        assert redis_conn.zcard(b.claims_key) == 0 and redis_conn.scard(b.record.executions_key) == 0
    assert not redis_conn.exists(f"rq:execution:{old.run}") and not redis_conn.exists(f"rq:execution:{new.run}")


def test_requeueing_a_dead_workers_canceled_run_leaves_the_jobs_next_run_alone(redis_conn):
    _, job_id, queue, dead, old, other, new = resubmitted_while_running(redis_conn, "w2")
    retries = Job.fetch(job_id, connection=redis_conn).retries_left
    redis_conn.delete(dead.record.key)
    assert other.requeue(dead.claims_key, died=True, owner="w1") == 1
    job = Job.fetch(job_id, connection=redis_conn)
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "w2" and job.retries_left == retries
    assert [e.id for e in job.get_executions()] == [new.execution_id]
    assert redis_conn.llen(f"rq:queue:{queue}") == 0


def test_a_cancel_settles_only_a_job_that_reads_canceled(redis_conn):
    """An engine abort ends a canceled job with no result; one whose status is not 'canceled'
    (nothing canceled it) is never written as finished: it fails with the reason."""
    enqueue(redis_conn, 2)
    bridge = bridge_for(redis_conn)
    canceled, other = bridge.claim(QUEUE, 2)
    Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer).cancel()
    assert bridge.finish([Finished(canceled, canceled=True), Finished(other, error="aborted", canceled=True)]) == 2
    assert Job.fetch("job-0", connection=redis_conn).get_status() == JobStatus.CANCELED
    assert redis_conn.xlen("rq:results:job-0") == 0
    assert Job.fetch("job-1", connection=redis_conn).get_status() == JobStatus.FAILED
    assert FailedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == ["job-1"]
    assert Worker.find_by_key(bridge.record.key, connection=redis_conn).failed_job_count == 1


def test_a_dead_workers_canceled_job_stays_canceled(redis_conn):
    queue, _ = enqueue(redis_conn, 2, retries=1)
    dead = bridge_for(redis_conn, "dead")
    dead.claim(QUEUE, 2)
    Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer).cancel()
    redis_conn.delete(dead.record.key)
    assert bridge_for(redis_conn, "alive").requeue(dead.claims_key, died=True, owner="dead") == 2
    assert queue.job_ids == ["job-1"]
    job = Job.fetch("job-0", connection=redis_conn)
    assert job.get_status() == JobStatus.CANCELED and job.get_executions() == []


def test_requeue_claims_of_a_dead_worker(redis_conn):
    queue, _ = enqueue(redis_conn, 5, retries=1)
    dead = bridge_for(redis_conn, "dead")
    dead.claim(QUEUE, 3)  # started: job-0..2
    redis_conn.zadd(dead.claims_key, {"job-3": 0})  # claimed first, never started (moved by hand)
    redis_conn.lrem("rq:queue:" + QUEUE, 1, "job-3")
    redis_conn.delete(dead.record.key)  # its record expired
    survivor = bridge_for(redis_conn, "alive")
    assert survivor.requeue(dead.claims_key, died=True, owner="dead") == 4
    assert queue.job_ids == ["job-3", "job-0", "job-1", "job-2", "job-4"], "back at the head, in claimed order"
    assert StartedJobRegistry(QUEUE, connection=redis_conn).get_job_ids() == []
    job = Job.fetch("job-0", connection=redis_conn)
    assert job.retries_left == 0 and job.get_status() == JobStatus.QUEUED and job.get_executions() == []
    assert Job.fetch("job-3", connection=redis_conn).retries_left == 1, "an unstarted job spent nothing"
    assert not redis_conn.exists(dead.claims_key)
    # requeueing twice never duplicates a queued job
    redis_conn.zadd(dead.claims_key, {"job-3": 0})
    survivor.requeue(dead.claims_key, died=True, owner="dead")
    assert queue.job_ids.count("job-3") == 1


def test_requeue_reads_the_claims_list_an_earlier_wicore_kept(redis_conn):
    """Workers of an earlier wicore kept their claims in a list; one killed before an upgrade
    leaves that list behind, and its jobs still go back to their queues."""
    queue, _ = enqueue(redis_conn, 3, retries=1)
    dead = bridge_for(redis_conn, "old")
    dead.claim(QUEUE, 2)
    redis_conn.delete(dead.claims_key)
    redis_conn.rpush(dead.claims_key, "job-0", "job-1")
    redis_conn.delete(dead.record.key)
    assert bridge_for(redis_conn, "new").requeue(dead.claims_key, died=True, owner="old") == 2
    assert queue.job_ids == ["job-0", "job-1", "job-2"] and not redis_conn.exists(dead.claims_key)


def test_a_dead_worker_out_of_retries_fails_its_job_and_a_live_one_is_left_alone(redis_conn):
    enqueue(redis_conn, 2)
    dead = bridge_for(redis_conn, "dead")
    dead.claim(QUEUE, 2)
    survivor = bridge_for(redis_conn, "alive")
    assert survivor.requeue(dead.claims_key, died=True, owner="dead") == -1, "its record is still there"
    assert redis_conn.zcard(dead.claims_key) == 2
    redis_conn.delete(dead.record.key)
    survivor.requeue(dead.claims_key, died=True, owner="dead")
    job = Job.fetch("job-0", connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED and "WorkerDied" in job.latest_result().exc_string
    assert sorted(FailedJobRegistry(QUEUE, connection=redis_conn).get_job_ids()) == ["job-0", "job-1"]


def test_finish_is_idempotent_and_skips_jobs_it_no_longer_holds(redis_conn):
    enqueue(redis_conn, 4)
    bridge = bridge_for(redis_conn)
    a, b, c, d = bridge.claim(QUEUE, 4)
    assert bridge.finish([Finished(a, result={"text": "once"})]) == 1
    assert bridge.finish([Finished(a, result={"text": "twice"})]) == 0, "written already"
    assert redis_conn.xlen("rq:results:job-0") == 1
    bridge.requeue(bridge.claims_key, [b.run], died=False)  # given back (an orphan), then finished late
    assert bridge.finish([Finished(b, result={"text": "late"}), Finished(c, error="ImageError: x")]) == 1
    assert Job.fetch("job-1", connection=redis_conn).get_status() == JobStatus.QUEUED
    assert redis_conn.xlen("rq:results:job-1") == 0
    assert bridge.finish([Finished(d, result={"text": "d"}), Finished(d, result={"text": "d again"})]) == 1
    assert redis_conn.xlen("rq:results:job-3") == 1, "a run given twice in one call is written once"


def test_claim_survives_every_kind_of_malformed_job_hash(redis_conn):
    """Each poison record fails (or is dead-lettered) alone; the good jobs claimed with it run."""
    import pickle

    queue, _ = enqueue(redis_conn, 2)
    poison = {
        "not-json": {"data": b"{oops"},
        "json-object": {"data": json.dumps({"a": 1})},
        "short-list": {"data": json.dumps(["wicore.worker.tasks.caption", None])},
        "bad-utf8": {"data": b"\xff\xfe[1]"},
        "deep": {"data": "[" * 100_000 + "]" * 100_000},
        "zlib-pickle": {"data": zlib.compress(pickle.dumps(("f", None, [1], {})))},
        "raw-pickle": {"data": pickle.dumps(("f", None, [1], {}))},
        "zlib-bomb": {"data": zlib.compress(b"[" + b" " * (40 * 2**20) + b"]")},
        "other-function": {"data": json.dumps(["os.system", None, ["true"], {}])},
        "pickle-meta": {"meta": pickle.dumps({"notify": "x"})},
        "list-meta": {"meta": "[1, 2]"},
        "no-data": {"data": None},
        "no-origin": {"origin": None},
        "bad-numbers": {"retries_left": "many", "result_ttl": "1e400", "timeout": "nan", "failure_ttl": "x"},
    }
    template = redis_conn.hgetall("rq:job:job-0")
    for name, fields in poison.items():
        record = {**template, **{k: v for k, v in fields.items() if v is not None}}
        for k, v in fields.items():
            if v is None:
                record.pop(k.encode(), None)
        redis_conn.hset(f"rq:job:{name}", mapping=record)
        redis_conn.rpush("rq:queue:" + QUEUE, name)
    redis_conn.rpush("rq:queue:" + QUEUE, "no-such-job", "bad id!", b"\xff\x00")
    bridge = bridge_for(redis_conn)
    claimed = bridge.claim(QUEUE, 100)
    invalid = {c.id: c.invalid for c in claimed if c.invalid}
    assert set(invalid) == set(poison) - {"no-origin", "bad-numbers"}
    assert all(reason.startswith("InvalidJob: ") for reason in invalid.values())
    assert {c.id for c in claimed if not c.invalid} == {"job-0", "job-1", "no-origin", "bad-numbers"}
    dead = [e[1] for e in redis_conn.xrange(keys.DEAD_LETTER)]
    assert sorted(e[b"id"] for e in dead) == sorted([b"no-such-job", b"bad id!", b"\xff\x00"])
    assert queue.count == 0 and redis_conn.zcard(bridge.claims_key) == len(claimed)

    items = [
        Finished(c, error=c.invalid) if c.invalid else Finished(c, error="EngineError: x", retry=True) for c in claimed
    ]
    assert bridge.finish(items) == len(claimed)
    failed = FailedJobRegistry(QUEUE, connection=redis_conn)
    assert set(failed.get_job_ids()) == set(invalid) | {"job-0", "job-1", "no-origin", "bad-numbers"}
    assert redis_conn.zcard(bridge.claims_key) == 0 and redis_conn.scard(bridge.record.executions_key) == 0
    for job_id, says in (("not-json", "InvalidJob: data is not JSON"), ("pickle-meta", "InvalidJob: meta is not JSON")):
        result = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).latest_result()
        assert result.exc_string.startswith(says)


def test_a_batching_run_leaves_records_rq_reads(redis_conn):
    """A worker's whole run (null engine): each job's end reads back through RQ's readers, the
    registries hold exactly their jobs, the worker's counters add up, and every key a job left
    behind expires."""
    producer = Producer(redis_conn, model="records")
    ok = producer.submit_many([Submission(png_bytes(i), f"job {i}") for i in range(6)])
    bad = producer.submit(b"not an image", "broken")
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=4))
    config = WorkerConfig("records", policy=BatchPolicy(max_batch_size=4, max_queue_delay_s=0), burst=True)
    worker = BatchingWorker(redis_conn, engine, config)
    assert worker.run() == 7
    jobs = {job_id: Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer) for job_id in [*ok, bad]}
    for job_id in ok:
        assert jobs[job_id].get_status() == JobStatus.FINISHED and jobs[job_id].return_value()["job_id"] == job_id
        assert jobs[job_id].latest_result().worker_name == worker.name
    assert jobs[bad].get_status() == JobStatus.FAILED and "ImageError" in jobs[bad].latest_result().exc_string
    origins = {job.origin for job in jobs.values()}
    finished = {i for q in origins for i in FinishedJobRegistry(q, connection=redis_conn).get_job_ids()}
    failed = {i for q in origins for i in FailedJobRegistry(q, connection=redis_conn).get_job_ids()}
    assert finished == set(ok) and failed == {bad}
    assert not any(StartedJobRegistry(q, connection=redis_conn).get_job_ids() for q in origins)
    record = Worker.find_by_key(worker.record.key, connection=redis_conn)
    assert (record.successful_job_count, record.failed_job_count) == (6, 1)
    assert not list(redis_conn.scan_iter("rq:execution*")), "execution records end with their jobs"
    left = [
        k
        for p in ("rq:job:*", "rq:results:*", "wicore:submitted:*", "wicore:notify:*")
        for k in redis_conn.scan_iter(p)
    ]
    assert len(left) >= 14 and all(redis_conn.ttl(key) > 0 for key in left)


def test_registries_are_pruned_of_expired_entries(redis_conn):
    redis_conn.zadd(f"rq:finished:{QUEUE}", {"old": 1, "new": 2**40})
    redis_conn.zadd(f"rq:failed:{QUEUE}", {"old": 1})
    bridge_for(redis_conn).prune_registries([QUEUE])
    assert redis_conn.zrange(f"rq:finished:{QUEUE}", 0, -1) == [b"new"]
    assert redis_conn.zcard(f"rq:failed:{QUEUE}") == 0
