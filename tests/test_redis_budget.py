"""The Redis budget of the batching path, counted on a real redis-server with INFO commandstats
(every command a Lua script runs counts): per job, enqueueing costs 2 commands, a claim 6 and a
settle 5; whatever a batch writes to one key goes out once per batch. A change that adds a command
per job fails here (docs/benchmarks.md, the queue benchmark, has the breakdown)."""

from __future__ import annotations

import pytest
from redis import Redis
from rq.serializers import JSONSerializer

from tests.helpers import CommandCount, png_bytes
from wicore.embedded import EmbeddedRedis
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.producer.client import chunks
from wicore.scheduler.policy import BatchPolicy
from wicore.scheduler.queues import BucketQueues
from wicore.worker import rq_scripts
from wicore.worker.loop import BatchingWorker
from wicore.worker.redis_link import PollPace
from wicore.worker.rq_bridge import Finished, RQBridge, RQWorkerRecord
from wicore.worker.worker_config import WorkerConfig

MODEL = "budget"
ENQUEUE_PER_JOB, CLAIM_PER_JOB, SETTLE_PER_JOB = 2, 6, 5
# Commands a call spends whatever its size: the script call, the claim's LPOP and its writes to
# the queue's started registry, the claims set, the worker's record and index, the cancel set,
# the claimants set; the settle's ZMSCORE and its once-per-key deletes, registry and
# notification writes, the worker's counters and state.
CLAIM_PER_CALL, SETTLE_PER_CALL = 10, 13
# A whole run, per job, beside each claim's and settle's fixed cost (CLAIM_PER_CALL, SETTLE_PER_CALL):
# enqueue excluded, the worker's start, polls and stop included. Alone ~11.1; how many calls a run
# makes depends on timing (a loaded machine claimed 3.4x as often, in smaller batches).
WORKER_RUN_PER_JOB = 12


@pytest.fixture(scope="module")
def server():
    """A redis-server of this module's own: the counts are the server's, so nothing else may run."""
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
def connection(server):
    with Redis.from_url(server.url) as conn:
        conn.flushdb()
        for script in (rq_scripts.CLAIM, rq_scripts.SETTLE, rq_scripts.REQUEUE):
            conn.script_load(script)  # a first call's NOSCRIPT and SCRIPT LOAD are not per-job costs
        yield conn


def submit(connection: Redis, n: int) -> list[str]:
    producer = Producer(connection, model=MODEL, config=ProducerConfig(retries=1))
    return producer.submit_many(Submission(png_bytes(i % 4), f"job {i}") for i in range(n))  # 4 distinct images


def started_bridge(connection: Redis) -> RQBridge:
    record = RQWorkerRecord([], name="budget-worker", connection=connection, serializer=JSONSerializer)
    record.register_birth()
    return RQBridge(record)


@pytest.mark.parametrize("n", [1, 64])
def test_a_claim_and_a_settle_cost_6_and_5_commands_a_job(connection, n):
    submit(connection, n)
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = started_bridge(connection)
    with CommandCount(connection) as claim:
        claimed = bridge.claim(queue, n)
    with CommandCount(connection) as settle:
        assert bridge.finish([Finished(c, result={"text": "ok"}) for c in claimed]) == n
    assert len(claimed) == n
    assert claim.total <= CLAIM_PER_JOB * n + CLAIM_PER_CALL, claim.by_name
    assert settle.total <= SETTLE_PER_JOB * n + SETTLE_PER_CALL, settle.by_name
    assert claim.by_name["hmget"] == n and settle.by_name["hmget"] == n, "one read of each job hash per phase"
    assert claim.by_name.get("evalsha") == settle.by_name.get("evalsha") == 1, "one script call per batch"
    assert claim.by_name["lpop"] == settle.by_name["zmscore"] == 1, "each call's marks (a whole run counts them)"


def test_failures_and_retries_stay_within_the_settle_budget(connection):
    """A failed job writes its failed registry entry and drops its dedup mark once per batch too;
    a retry is requeued (its LPOS, RPUSH and SADD are the only per-job extras)."""
    n = 32
    submit(connection, n)
    [queue] = BucketQueues(connection, MODEL).names()
    bridge = started_bridge(connection)
    claimed = bridge.claim(queue, n)
    failed, retried = claimed[: n // 2], claimed[n // 2 :]
    items = [Finished(c, error="ImageError: x") for c in failed] + [Finished(c, error="E", retry=True) for c in retried]
    with CommandCount(connection) as settle:
        assert bridge.finish(items) == n
    retry_extras = 3 * len(retried)
    assert settle.total <= SETTLE_PER_JOB * n + SETTLE_PER_CALL + retry_extras, settle.by_name
    assert settle.by_name["zadd"] == 1 and settle.by_name["del"] == 1, "failed registry and marks once a batch"


def test_enqueueing_costs_2_commands_a_job(connection):
    n, images = 256, 4
    Producer(connection, model=MODEL).submit(png_bytes(99), "loads the producer's script")
    with CommandCount(connection) as enqueue:
        submit(connection, n)
    # A chunk's script call, MULTI/EXEC, one DEL, RPUSH and SADD per queue, the doorbell's three;
    # per distinct image a lookup and a store.
    per_chunk = 10 + 2 * images
    chunk_count = len(list(chunks(range(n), 256)))  # a bulk submit's chunks ramp up to 256
    assert enqueue.total <= ENQUEUE_PER_JOB * n + per_chunk * chunk_count, enqueue.by_name
    assert enqueue.by_name["hset"] == n and enqueue.by_name["rpush"] == chunk_count


def test_a_worker_run_stays_within_12_commands_a_job(connection):
    n, batch = 1024, 256
    ids = submit(connection, n)
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=batch))
    policy = BatchPolicy(max_batch_size=batch, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL, policy=policy, burst=True, max_jobs=n))
    with CommandCount(connection) as run:
        assert worker.run() == n
    calls = CLAIM_PER_CALL * run.by_name["lpop"] + SETTLE_PER_CALL * run.by_name["zmscore"]
    per_job = (run.total - calls) / n
    assert per_job <= WORKER_RUN_PER_JOB, f"{per_job:.2f} commands a job beside its calls': {run.by_name}"
    statuses = {connection.hget(f"rq:job:{job_id}", "status") for job_id in ids}
    assert statuses == {b"finished"}


def test_cancel_polls_follow_engine_steps_not_loop_turns():
    """The worker reads its cancel set once per engine step; turns that only wait for images poll
    at most every `every_s`, however many there are."""
    pace = PollPace(every_s=3600)
    assert pace.due() and not pace.due() and not pace.due()
    pace.stepped = True
    assert pace.due() and not pace.due()


def test_only_streaming_jobs_write_token_streams_at_most_once_a_step(connection, fast_engine):
    """The fast engine on the tiny model, two jobs that stream and two that do not: the ones that
    do not write nothing beyond the budget above; each streaming job adds at most one XADD (and
    its EXPIRE) per engine step, into a capped stream of its own."""
    from wicore import keys
    from wicore.schemas import GenerationParams

    def job(i: int, stream: bool) -> Submission:
        params = GenerationParams(max_new_tokens=12, ignore_eos=True, stream=stream)
        return Submission(png_bytes(i), f"job {i}", params=params)

    producer = Producer(connection, model=MODEL, config=ProducerConfig(retries=1))
    streaming = producer.submit_many([job(0, True), job(1, True)])
    plain = producer.submit_many([job(2, False), job(3, False)])
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, fast_engine, WorkerConfig(MODEL, policy=policy, burst=True, max_jobs=4))
    with CommandCount(connection) as run:
        assert worker.run() == 4
    entries = sum(connection.xlen(keys.tokens(job_id)) for job_id in streaming)
    assert run.by_name["xadd"] == entries + 4, "a token entry each, and each job's result entry"
    assert entries <= 2 * fast_engine.stats()["steps"]
    for job_id in streaming:
        assert 3 <= connection.xlen(keys.tokens(job_id)) <= 12 and connection.ttl(keys.tokens(job_id)) > 0
    assert not any(connection.exists(keys.tokens(job_id)) for job_id in plain)
