"""The scheduler's Redis part: queue heads read in one round trip, whatever the head job holds."""

from __future__ import annotations

import time

from tests.helpers import plant_job, png_bytes
from wicore.producer import Producer
from wicore.scheduler.policy import BatchPolicy, Take, choose
from wicore.scheduler.queues import BucketQueues


def test_a_head_without_a_readable_enqueue_time_counts_as_oldest(redis_conn):
    """A head job whose hash was evicted, or whose enqueued_at is garbage, must not keep its queue
    waiting for a full batch: its head reads as the oldest possible, so the batch goes now."""
    producer = Producer(redis_conn, model="m")
    fresh = producer.submit(png_bytes(1), "fresh")
    queues = BucketQueues(redis_conn, "m")
    [head] = queues.heads()
    assert abs(head.oldest_at - time.time()) < 60
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=600)
    assert not isinstance(choose([head], 8, policy, time.time()), Take), "one fresh job waits for company"

    queue = head.bucket.queue_name
    for broken in ("evicted", "garbled"):
        redis_conn.lrem(f"rq:queue:{queue}", 0, broken)
        plant_job(redis_conn, queue, broken, fresh, enqueued_at="not a time" if broken == "garbled" else None)
        redis_conn.lrem(f"rq:queue:{queue}", 1, broken)
        redis_conn.lpush(f"rq:queue:{queue}", broken)
        if broken == "evicted":
            redis_conn.delete(f"rq:job:{broken}")
        [head] = queues.heads()
        assert head.oldest_at == 0.0
        assert isinstance(choose([head], 8, policy, time.time()), Take), f"{broken} head: the batch goes now"
        redis_conn.lpop(f"rq:queue:{queue}")
