"""wicore's copies of RQ's key prefixes (`wicore.rq_keys`) are the keys RQ computes, no Lua script
spells an RQ key itself, and under another RQ_KEY_PREFIX a job's whole life lands where RQ reads
it."""

from __future__ import annotations

import os
import subprocess
import sys

from rq import Queue, worker_registration
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job
from rq.results import Result
from rq.worker import Worker

from wicore import rq_keys
from wicore.producer import canceling, claims
from wicore.scheduler import queues
from wicore.worker import liveness, rq_scripts


def test_each_prefix_is_the_key_rq_computes(redis_conn):
    queue = Queue("q", connection=redis_conn)
    worker = Worker([queue], name="w1", connection=redis_conn)
    assert Job.key_for("j1") == rq_keys.JOB + "j1"
    assert queue.key == rq_keys.QUEUE + "q" and Queue.redis_queues_keys == rq_keys.QUEUES
    assert Result.get_key("j1") == rq_keys.RESULTS + "j1"
    assert ExecutionRegistry("j1", connection=redis_conn).key == rq_keys.EXECUTIONS + "j1"
    assert Execution("e1", "j1", connection=redis_conn).key == rq_keys.EXECUTION + "j1:e1"
    registries = {
        rq_keys.STARTED: queue.started_job_registry,
        rq_keys.FINISHED: queue.finished_job_registry,
        rq_keys.FAILED: queue.failed_job_registry,
        rq_keys.CANCELED: queue.canceled_job_registry,
        rq_keys.DEFERRED: queue.deferred_job_registry,
        rq_keys.SCHEDULED: queue.scheduled_job_registry,
    }
    for prefix, registry in registries.items():
        assert prefix + "q" == registry.key
    assert worker.key == rq_keys.WORKER + "w1" and rq_keys.worker_executions("w1") == worker.executions_key
    assert rq_keys.WORKERS == worker_registration.REDIS_WORKER_KEYS


def test_no_lua_script_spells_an_rq_key():
    scripts = [rq_scripts.CLAIM, rq_scripts.SETTLE, rq_scripts.REQUEUE, claims._MARK_LUA, canceling._CANCEL_LUA]
    scripts += [queues._HEADS_LUA, liveness._BEAT_LUA]
    for script in scripts:
        assert "rq:" not in script.replace(rq_keys.LUA_PREAMBLE, ""), script[:400]


# A Producer's jobs through a burst worker (null engine), in a process whose rq reads RQ_KEY_PREFIX.
LIFE = """
import sys
from redis import Redis
from tests.helpers import png_bytes
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

connection = Redis.from_url(sys.argv[1])
producer = Producer(connection, model="alt")
ids = producer.submit_many([Submission(png_bytes(i), f"job {i}") for i in range(3)])
producer.cancel([producer.submit(png_bytes(9), "canceled while queued")])
engine = NullEngine(EngineConfig(model_dir="", max_batch_size=4))
policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0)
assert BatchingWorker(connection, engine, WorkerConfig("alt", policy=policy, burst=True)).run() == 3
assert {o.status for o in producer.wait(ids, timeout=10)} == {"finished"}
"""


def test_a_jobs_life_follows_another_rq_key_prefix(redis_url, redis_conn):
    env = {**os.environ, "RQ_KEY_PREFIX": "alt"}
    subprocess.run([sys.executable, "-c", LIFE, redis_url], env=env, check=True, timeout=120)
    written = {key.decode() for key in redis_conn.scan_iter()}
    assert not [key for key in written if key.startswith("rq:")], sorted(written)
    for kind in ("job", "results", "finished", "canceled", "worker"):
        assert any(key.startswith(f"alt:{kind}:") for key in written), (kind, sorted(written))
    assert "alt:queues" in written
