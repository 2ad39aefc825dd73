"""The batch former's policy and the shape buckets, without Redis."""

from __future__ import annotations

import pytest

from wicore.scheduler.buckets import NEW_TOKEN_BUCKETS, BucketKey, ShapeRules, bucket_up
from wicore.scheduler.policy import BatchPolicy, QueueHead, Take, Wait, choose, split_expired
from wicore.schemas import CaptionJob, ChatMessage, GenerationParams, ImageRef, Lane

SHA = "a" * 64


def head(lane=Lane.NORMAL, length=1, oldest_at=100.0, prompt=64):
    return QueueHead(BucketKey("m", lane, 1, prompt, 64), length, oldest_at)


def test_bucket_up_takes_first_edge_at_or_above():
    assert bucket_up(1, NEW_TOKEN_BUCKETS) == 16
    assert bucket_up(64, NEW_TOKEN_BUCKETS) == 64
    assert bucket_up(65, NEW_TOKEN_BUCKETS) == 128
    assert bucket_up(10**9, NEW_TOKEN_BUCKETS) == NEW_TOKEN_BUCKETS[-1]


def test_queue_name_round_trips_and_rejects_others():
    key = BucketKey("democap", Lane.HIGH, 1, 128, 32)
    assert key.queue_name == "wicore.democap.high.c1.p128.n32"
    assert BucketKey.parse(key.queue_name) == key
    assert BucketKey.parse("default") is None
    assert BucketKey.parse("wicore.m.urgent.c1.p1.n1") is None


def test_rules_bucket_by_lane_prompt_and_new_tokens():
    rules = ShapeRules()
    short = CaptionJob(image=ImageRef(sha256=SHA), model="m", prompt="hi")
    long = short.model_copy(update={"prompt": "word " * 200, "params": GenerationParams(max_new_tokens=100)})
    urgent = short.model_copy(update={"priority": Lane.HIGH})
    assert rules.bucket(short) == BucketKey("m", Lane.NORMAL, 1, 64, 64)
    assert rules.bucket(long) == BucketKey("m", Lane.NORMAL, 1, 512, 128)
    assert rules.bucket(urgent).lane is Lane.HIGH


def test_rules_bucket_by_image_count_and_the_whole_conversation():
    rules = ShapeRules()
    text_only = CaptionJob(model="m", prompt="hi")
    pair = CaptionJob(images=(ImageRef(sha256=SHA), ImageRef(sha256="b" * 64)), model="m", prompt="hi")
    turns = [ChatMessage(role="system", content="word " * 60), ChatMessage(role="user", content="hi")]
    chat = CaptionJob(model="m", messages=turns)
    assert rules.bucket(text_only).crops == 0 and rules.bucket(pair).crops == 2
    assert rules.bucket(text_only).queue_name == "wicore.m.normal.c0.p64.n64"
    assert rules.bucket(chat).prompt == 128  # the system turn's text counts
    assert text_only.job_id != pair.job_id != pair.model_copy(update={"images": pair.images[::-1]}).job_id


def test_full_batch_goes_at_once():
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0)
    assert choose([head(length=20, oldest_at=100.0)], 64, policy, now=100.0) == Take(head().bucket.queue_name, 8)


def test_engine_capacity_caps_the_batch():
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0)
    assert choose([head(length=20)], 3, policy, now=100.0).count == 3
    assert choose([head(length=20)], 0, policy, now=100.0) is None


def test_partial_batch_waits_until_max_queue_delay():
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.5)
    decision = choose([head(length=3, oldest_at=100.0)], 8, policy, now=100.2)
    assert isinstance(decision, Wait) and decision.seconds == pytest.approx(0.3)
    assert choose([head(length=3, oldest_at=100.0)], 8, policy, now=100.5) == Take(head().bucket.queue_name, 3)


def test_high_lane_first_then_oldest_head():
    policy = BatchPolicy(max_batch_size=2, max_queue_delay_s=0.0)
    normal_old = head(Lane.NORMAL, 5, oldest_at=1.0, prompt=64)
    normal_new = head(Lane.NORMAL, 5, oldest_at=5.0, prompt=128)
    high_new = head(Lane.HIGH, 5, oldest_at=9.0, prompt=256)
    assert choose([normal_new, normal_old, high_new], 8, policy, 10.0).queue_name == high_new.bucket.queue_name
    assert choose([normal_new, normal_old], 8, policy, 10.0).queue_name == normal_old.bucket.queue_name


def test_empty_queues_mean_nothing_to_do():
    assert choose([head(length=0)], 8, BatchPolicy(), 0.0) is None
    assert choose([], 8, BatchPolicy(), 0.0) is None


def test_split_expired():
    live, expired = split_expired([("a", None), ("b", 5.0), ("c", 50.0)], lambda x: x[1], now=10.0)
    assert [x[0] for x in live] == ["a", "c"] and [x[0] for x in expired] == ["b"]


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=0)


def test_the_last_free_slots_are_the_high_lanes():
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0, high_lane_slots=2)
    normal, high = head(Lane.NORMAL, 20), head(Lane.HIGH, 20)
    assert choose([normal], 8, policy, 100.0).count == 6, "bulk leaves the reserved slots free"
    assert choose([normal], 2, policy, 100.0) is None, "only reserved slots left: bulk waits in Redis"
    assert choose([normal, high], 2, policy, 100.0) == Take(high.bucket.queue_name, 2)
    low = head(Lane.LOW, 20)
    assert choose([low], 3, policy, 100.0).count == 1


def test_an_unripe_high_batch_waits_even_when_bulk_has_no_room():
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.5, high_lane_slots=2)
    decision = choose([head(Lane.NORMAL, 20, oldest_at=1.0), head(Lane.HIGH, 1, oldest_at=100.0)], 2, policy, 100.2)
    assert isinstance(decision, Wait) and decision.seconds == pytest.approx(0.3)


def test_high_lane_slots_default_to_one_in_sixteen_and_leave_bulk_a_slot():
    assert BatchPolicy(max_batch_size=384).reserved == 24
    assert BatchPolicy(max_batch_size=8).reserved == 0, "small engines keep every slot for everyone"
    assert BatchPolicy(max_batch_size=4, high_lane_slots=3).reserved == 3
    with pytest.raises(ValueError, match="high_lane_slots must be >= 0 and < max_batch_size, got 4"):
        BatchPolicy(max_batch_size=4, high_lane_slots=4)
    with pytest.raises(ValueError, match="got -1"):
        BatchPolicy(max_batch_size=4, high_lane_slots=-1)
