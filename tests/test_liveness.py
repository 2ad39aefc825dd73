"""A worker's record in RQ's registry: the heartbeat keeps it whole, registering the worker again
when Redis lost the record or kept only part of it, and a worker starting under a name takes
over what a lost record left of it."""

from __future__ import annotations

from rq.serializers import JSONSerializer
from rq.worker import Worker

from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.worker.liveness import Heartbeat
from wicore.worker.loop import BatchingWorker
from wicore.worker.rq_bridge import RQWorkerRecord
from wicore.worker.worker_config import WorkerConfig


def test_the_heartbeat_registers_again_over_a_partial_record(redis_conn):
    record = RQWorkerRecord([], name="hb", connection=redis_conn, serializer=JSONSerializer)
    record.register_birth()
    heartbeat = Heartbeat(record, heartbeat_s=1, ttl_s=3)
    assert heartbeat.keep_registered() is False and heartbeat.take_registered_again() is False
    redis_conn.flushall()
    redis_conn.hincrby(record.key, "successful_job_count", 1)  # what a settle writes after the wipe
    assert heartbeat.beat() is False, "a partial record is no live worker's"
    assert heartbeat.keep_registered() is True
    assert heartbeat.take_registered_again() is True and heartbeat.take_registered_again() is False
    [worker] = Worker.all(connection=redis_conn)
    assert worker.name == "hb" and worker.birth_date is not None and 0 < redis_conn.ttl(record.key) <= 3
    assert heartbeat.keep_registered() is False


def test_a_worker_takes_over_what_a_lost_record_left_of_its_name(redis_conn):
    redis_conn.hset("rq:worker:lost", mapping={"state": "busy", "successful_job_count": 3})  # no TTL, no birth
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=2))
    worker = BatchingWorker(redis_conn, engine, WorkerConfig("m", name="lost", burst=True, liveness_ttl_s=60))
    assert worker.run() == 0, "started at once, instead of waiting for a record that never expires"
