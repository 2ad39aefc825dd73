"""Jobs over two independent redis-servers (README.md, "Past one Redis"): the producer puts each
job on the shard its id hashes to, a worker per shard runs it, and every reader finds it there;
per job, each shard spends what one Redis does."""

from __future__ import annotations

import pytest
from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from tests.helpers import CommandCount, png_bytes, queued_ids
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.errors import ResultTimeout
from wicore.producer import ShardedProducer, Submission, shard_of
from wicore.producer.client import chunks
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL = "sharded"


def serve(connection: Redis) -> BatchingWorker:
    """A worker of this shard alone, run until its queues are empty."""
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=16))
    policy = BatchPolicy(max_batch_size=16, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL, policy=policy, burst=True))
    worker.run()
    return worker


def test_each_job_is_enqueued_run_and_read_on_its_own_shard(shards):
    producer = ShardedProducer(shards, model=MODEL)
    ids = producer.submit_many([Submission(png_bytes(i), f"job {i}") for i in range(40)])
    bad = producer.submit(b"not an image", "broken")
    assert producer.submit(png_bytes(3), "job 3") == ids[3] and len(set(ids)) == 40, "the same work, deduplicated"
    on = [queued_ids(connection) for connection in shards]
    assert on[0] and on[1] and not on[0] & on[1] and on[0] | on[1] == {*ids, bad}
    assert all(shard_of(job_id, 2) == k for k, held in enumerate(on) for job_id in held)

    workers = [serve(connection) for connection in shards]
    assert [w.jobs_done for w in workers] == [len(held) for held in on]
    outcomes = {o.job_id: o for o in producer.wait([*ids, bad], timeout=30)}
    assert all(outcomes[job_id].result.job_id == job_id for job_id in ids)
    assert outcomes[bad].error.startswith("ImageError")
    for job_id in [*ids, bad]:
        home = shard_of(job_id, 2)
        job = Job.fetch(job_id, connection=producer.connection_for(job_id), serializer=JSONSerializer)
        assert job.get_status() == (JobStatus.FAILED if job_id == bad else JobStatus.FINISHED)
        assert job.latest_result().worker_name == workers[home].name
        with pytest.raises(NoSuchJobError):
            Job.fetch(job_id, connection=shards[1 - home], serializer=JSONSerializer)
        registry = FailedJobRegistry if job_id == bad else FinishedJobRegistry
        assert job_id in registry(job.origin, connection=shards[home]).get_job_ids()


def test_a_cancel_reaches_every_shard_and_nothing_runs(shards):
    producer = ShardedProducer(shards, model=MODEL)
    ids = producer.submit_many([Submission(png_bytes(i), f"doomed {i}") for i in range(8)])
    assert {shard_of(job_id, 2) for job_id in ids} == {0, 1}
    assert producer.cancel([*ids, "no-such-job"]) == {**dict.fromkeys(ids, "canceled"), "no-such-job": "missing"}
    assert [serve(connection).jobs_done for connection in shards] == [0, 0]
    assert all(producer.outcome(job_id).canceled for job_id in ids)


def test_waiting_on_jobs_no_worker_runs_times_out_across_shards(shards):
    producer = ShardedProducer(shards, model=MODEL)
    ids = producer.submit_many([Submission(png_bytes(i), f"waits {i}") for i in range(6)])
    with pytest.raises(ResultTimeout):
        list(producer.wait(ids, timeout=0.3))


def test_sharding_adds_no_command_per_job(shards):
    """Enqueueing N jobs over two shards costs what it costs on one Redis: 2 commands a job, plus
    each touched shard's per-chunk calls."""
    producer = ShardedProducer(shards, model=MODEL)
    loaded, i = set(), 0
    while loaded != {0, 1}:  # a first submission on each shard loads its script
        loaded.add(shard_of(producer.submit(png_bytes(99), f"loads the script {i}"), 2))
        i += 1
    n = 128
    with CommandCount(shards[0]) as first, CommandCount(shards[1]) as second:
        producer.submit_many(Submission(png_bytes(i % 2), f"counted {i}") for i in range(n))
    per_chunk = 10 + 2 * 2  # as on one Redis (tests/test_redis_budget.py): calls, then 2 per distinct image
    calls = 2 * per_chunk * len(list(chunks(range(n), 256)))  # each chunk touches both shards
    assert first.total + second.total <= 2 * n + calls, (first.by_name, second.by_name)
