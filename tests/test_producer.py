"""The producer on a real redis-server: a submission that never reached a queue never blocks its
job id."""

from __future__ import annotations

import pytest
from redis import Redis
from redis.exceptions import OutOfMemoryError

from tests.helpers import png_bytes
from wicore import keys
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, Submission


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
