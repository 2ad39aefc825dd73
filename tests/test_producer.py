"""The producer on a real redis-server: a submission that never reached a queue never blocks its
job id."""

from __future__ import annotations

import pytest
from redis import Redis
from redis.exceptions import OutOfMemoryError
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.helpers import png_bytes
from wicore import keys
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.producer.rq_records import TASK
from wicore.schemas import CaptionJob


def queued_ids(connection: Redis) -> list[bytes]:
    return [i for key in connection.scan_iter("rq:queue:*") for i in connection.lrange(key, 0, -1)]


def test_a_submission_refused_for_memory_can_be_submitted_again():
    with EmbeddedRedis() as server, Redis.from_url(server.url) as connection:
        producer = Producer(connection, model="m")
        connection.config_set("maxmemory-policy", "noeviction")
        connection.config_set("maxmemory", connection.info("memory")["used_memory"] // 2)
        with pytest.raises(OutOfMemoryError):
            producer.submit(png_bytes(1), "refused")
        connection.config_set("maxmemory", 0)
        job_id = producer.submit(png_bytes(1), "refused")
        assert queued_ids(connection) == [job_id.encode()]
        assert producer.outcome(job_id).status == "queued"


def test_a_mark_without_a_job_is_a_submission_that_never_happened(redis_conn):
    """The dedup mark is written a round trip before the enqueue: a producer that dies between the
    two leaves a mark with no job behind. The next submission of that work enqueues it, once."""
    producer = Producer(redis_conn, model="m")
    job_id = producer.submit(png_bytes(2), "orphaned mark")
    for key in [f"rq:job:{job_id}", *redis_conn.scan_iter("rq:queue:*")]:
        redis_conn.delete(key)
    assert redis_conn.exists(keys.submitted(job_id))

    assert Producer(redis_conn, model="m").submit(png_bytes(2), "orphaned mark") == job_id
    assert producer.submit(png_bytes(2), "orphaned mark") == job_id
    assert queued_ids(redis_conn) == [job_id.encode()], "enqueued again, and only once"
    assert producer.outcome(job_id).status == "queued"


def test_cancel_own_queued_only_takes_this_producers_unstarted_jobs_whatever_their_hashes_hold(redis_conn):
    """A job hash RQ could not restore (a bad date, no `data`, meta that is not JSON) is canceled
    like any other; a started job, another producer's job and an unknown id keep their status."""
    producer, other = Producer(redis_conn, model="m"), Producer(redis_conn, model="m")
    ids = producer.submit_many([Submission(png_bytes(10 + i), f"job {i}") for i in range(4)])
    foreign = other.submit(png_bytes(20), "another producer's")
    redis_conn.hset(f"rq:job:{ids[0]}", "created_at", "not a date")
    redis_conn.hdel(f"rq:job:{ids[1]}", "data")
    redis_conn.hset(f"rq:job:{ids[1]}", "meta", "not json")
    redis_conn.hset(f"rq:job:{ids[2]}", "status", "started")  # a worker took it
    statuses = producer.cancel([*ids, foreign, "no-such-job", ids[0]], own_queued_only=True)
    assert statuses == {
        ids[0]: "canceled",
        ids[1]: "canceled",
        ids[2]: "started",
        ids[3]: "canceled",
        foreign: "queued",
        "no-such-job": "missing",
    }
    assert queued_ids(redis_conn) == [ids[2].encode(), foreign.encode()]
    for job_id in (ids[0], ids[1], ids[3]):
        assert redis_conn.hget(f"rq:job:{job_id}", "status") == b"canceled"
        assert not redis_conn.exists(keys.submitted(job_id))
    assert redis_conn.exists(keys.submitted(ids[2]), keys.submitted(foreign)) == 2
    assert producer.outcome(ids[1]).canceled, "an unreadable job hash still reads canceled"
    assert producer.submit(png_bytes(13), "job 3") == ids[3] and ids[3].encode() in queued_ids(redis_conn)


def test_the_job_records_are_the_ones_rq_enqueue_many_writes(redis_conn):
    """The producer writes RQ's job hash itself (one HSET a job, one RPUSH a queue): field for
    field it is what `Queue.enqueue_many` writes for the same job, so RQ, rq-dashboard and
    `Job.fetch` read it as their own."""
    producer = Producer(redis_conn, model="m", config=ProducerConfig(retries=2))
    submission = Submission(png_bytes(3), "compare", name="compare-me")
    [job_id] = producer.submit_many([submission])
    ours, [queue_key] = redis_conn.hgetall(f"rq:job:{job_id}"), list(redis_conn.scan_iter("rq:queue:*"))
    queue = Queue(queue_key.decode().removeprefix("rq:queue:"), connection=redis_conn, serializer=JSONSerializer)
    assert queue.job_ids == [job_id] and redis_conn.sismember("rq:queues", queue.key)
    fetched = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    redis_conn.delete(f"rq:job:{job_id}", queue.key)
    config = producer.config
    data = Queue.prepare_data(
        TASK,
        args=fetched.args,  # the payload carries its submission time: the same one
        job_id=job_id,
        timeout=config.job_timeout_s,
        result_ttl=config.result_ttl_s,
        failure_ttl=config.failure_ttl_s,
        retry=Retry(max=config.retries),
        meta={"notify": producer.notify_key},
        description="caption compare-me",
    )
    queue.enqueue_many([data])
    theirs = redis_conn.hgetall(f"rq:job:{job_id}")
    stamps = {b"created_at", b"enqueued_at"}
    assert {k: v for k, v in ours.items() if k not in stamps} == {k: v for k, v in theirs.items() if k not in stamps}
    assert set(ours) == set(theirs) and queue.job_ids == [job_id]
    assert CaptionJob.model_validate(fetched.args[0]).job_id == job_id and fetched.retries_left == 2


def test_resubmitting_a_failed_job_starts_from_a_fresh_record(redis_conn):
    """A failed job keeps its hash for failure_ttl; submitting the work again enqueues it anew,
    without the old run's fields or the TTL its failure set."""
    producer = Producer(redis_conn, model="m")
    job_id = producer.submit(png_bytes(4), "again")
    key = f"rq:job:{job_id}"
    redis_conn.hset(key, mapping={"status": "failed", "ended_at": "2020-01-01T00:00:00.000000Z"})
    redis_conn.expire(key, 60)
    redis_conn.delete(keys.submitted(job_id), *redis_conn.scan_iter("rq:queue:*"))  # as the failure left it
    assert producer.submit(png_bytes(4), "again") == job_id
    assert redis_conn.hget(key, "status") == b"queued" and not redis_conn.hget(key, "ended_at")
    assert redis_conn.ttl(key) == -1 and queued_ids(redis_conn) == [job_id.encode()]


def test_a_bulk_submit_enqueues_its_first_jobs_before_it_reads_the_rest(redis_conn):
    """Workers start on a first small chunk while the producer still reads and hashes images;
    chunks then double up to `chunk`."""
    from wicore.producer.client import FIRST_CHUNK

    producer = Producer(redis_conn, model="m")
    queued_before: list[int] = []

    def submissions():
        for i in range(200):
            queued_before.append(len(queued_ids(redis_conn)))
            yield Submission(png_bytes(i, (8, 8)), "x")

    ids = producer.submit_many(submissions(), chunk=4 * FIRST_CHUNK)
    assert len(set(ids)) == 200 and len(queued_ids(redis_conn)) == 200
    ends = [16, 48, 112, 176]  # chunks of 16, 32, 64, 64, then the last 24
    assert FIRST_CHUNK == 16 and [i for i in range(1, 200) if queued_before[i] > queued_before[i - 1]] == ends
    assert [queued_before[i] for i in ends] == ends
