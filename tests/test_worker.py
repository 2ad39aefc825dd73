"""The batching worker end to end on a real redis-server and the tiny Gemma-3 (reference
engine, CPU): results, per-job failures, deadlines, no pickle, dedup, liveness."""

from __future__ import annotations

import base64
import json
import logging
import pickletools
import re
import threading
import time
import zlib

import pytest
from redis import Redis
from rq.job import Job

from tests.helpers import all_values, png_bytes
from wicore.engines import EngineConfig
from wicore.engines.reference import ReferenceEngine
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import GenerationParams
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return ReferenceEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4))


def run_worker(connection: Redis, engine, **config) -> BatchingWorker:
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0)
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL, policy=policy, burst=True, **config))
    worker.run()
    return worker


def outcomes(producer: Producer, ids: list[str]) -> dict:
    return {o.job_id: o for o in producer.wait(ids, timeout=30)}


def test_results_for_a_mixed_batch_and_bad_images_fail_alone(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=5)
    good = [Submission(png_bytes(i), f"prompt number {i}", params=params) for i in range(6)]
    broken = [Submission(b"\x89PNG\r\n\x1a\n garbage", params=params), Submission(b"not an image", params=params)]
    ids = producer.submit_many(good + broken)
    worker = run_worker(redis_conn, engine)
    assert worker.jobs_done == 8
    results = outcomes(producer, ids)
    for job_id in ids[:6]:
        result = results[job_id].result
        assert result is not None and result.output_tokens == 5 and result.engine == "reference"
        assert result.worker == worker.name and result.timings.total_s >= result.timings.engine_s > 0
    for job_id in ids[6:]:
        assert results[job_id].result is None and results[job_id].error.startswith("ImageError")


def test_log_has_a_line_per_batch_and_a_warning_per_failed_job(redis_conn, engine, caplog):
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=3)
    ids = producer.submit_many([Submission(png_bytes(i), "x", params=params) for i in range(3)])
    bad = producer.submit(b"not an image", "x", params=params)
    with caplog.at_level(logging.INFO, logger="wicore.worker.batches"):
        run_worker(redis_conn, engine)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"job {bad} failed: ImageError: not an image Pillow can identify: unknown format or "
                        "broken header (starts with b'not an i')"]  # fmt: skip
    batches = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(batches) == 1, batches  # the four jobs share one bucket and one claim
    assert re.fullmatch(r"batch wicore\.tiny\.normal\.\S+: 4 jobs \(1 failed\) in \d+ ms, [\d.]+ tokens/s", batches[0])
    assert len(ids) == 3


def test_batch_output_equals_one_by_one(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=6)
    subs = [Submission(png_bytes(100 + i), "Describe this image." + " more" * i, params=params) for i in range(4)]
    ids = producer.submit_many(subs)
    run_worker(redis_conn, engine)
    batched = outcomes(producer, ids)
    for sub, job_id in zip(subs, ids):
        [alone] = engine.generate([_request(job_id, sub)])
        assert list(batched[job_id].result.token_ids) == alone.token_ids


def _request(job_id, sub):
    from wicore.engines.base import EngineRequest
    from wicore.ops.image_decode import decode_image

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sub.prompt}]}]
    return EngineRequest(job_id, chat, [decode_image(sub.image)], sub.params)


def test_job_past_its_deadline_fails_and_never_runs(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL)
    late = producer.submit(png_bytes(1), "late", deadline=time.time() - 1)
    on_time = producer.submit(
        png_bytes(2), "on time", deadline=time.time() + 600, params=GenerationParams(max_new_tokens=2)
    )
    seen_before = engine.requests_seen
    run_worker(redis_conn, engine)
    results = outcomes(producer, [late, on_time])
    assert results[late].error.startswith("DeadlineExceeded") and "not run" in results[late].error
    assert results[on_time].result is not None
    assert engine.requests_seen - seen_before == 1, "the late job never reached the engine"


def test_same_work_submitted_twice_runs_once(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=2)
    first = producer.submit(png_bytes(7), "same", params=params)
    second = Producer(redis_conn, model=MODEL).submit(png_bytes(7), "same", params=params, metadata={"other": 1})
    assert first == second
    worker = run_worker(redis_conn, engine)
    assert worker.jobs_done == 1
    assert redis_conn.xlen(f"rq:results:{first}") == 1
    assert len([k for k in redis_conn.scan_iter("wicore:blob:*")]) == 1, "the image is stored once"


def test_redis_holds_no_pickle(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL)
    ids = producer.submit_many(
        [Submission(png_bytes(i), "x", params=GenerationParams(max_new_tokens=2)) for i in (1, 2)]
    )
    ids.append(producer.submit(b"broken"))
    run_worker(redis_conn, engine)
    outcomes(producer, ids)
    for value in all_values(redis_conn):
        for candidate in _decodings(value):
            assert not _is_pickle(candidate), f"pickle found in Redis: {candidate[:40]!r}"
    job = Job.fetch(ids[0], connection=redis_conn)
    payload = json.loads(zlib.decompress(redis_conn.hget(job.key, "data")))
    assert payload[0] == "wicore.worker.tasks.caption" and payload[2][0]["model"] == MODEL


def _decodings(value: bytes):
    """The value, and what it holds when it is zlib- or base64-wrapped (RQ wraps both ways)."""
    yield value
    for decode in (zlib.decompress, base64.b64decode, lambda v: zlib.decompress(base64.b64decode(v))):
        try:
            yield decode(value)
        except Exception:
            continue


def _is_pickle(data: bytes) -> bool:
    if not data or data[:1] != b"\x80" or len(data) < 3:
        return False
    try:
        pickletools.dis(data, out=open("/dev/null", "w"))  # noqa: SIM115
        return True
    except Exception:
        return False


def test_worker_publishes_stats_and_registers_with_rq(redis_conn, engine):
    producer = Producer(redis_conn, model=MODEL, config=ProducerConfig())
    producer.submit(png_bytes(3), "x", params=GenerationParams(max_new_tokens=2))
    worker = run_worker(redis_conn, engine)
    stats = json.loads(redis_conn.get(f"wicore:stats:{worker.name}"))
    assert stats["jobs_done"] == 1 and stats["in_flight"] == 0
    identity = {key: stats[key] for key in ("model", "engine", "device", "dtype")}
    assert identity == {"model": MODEL, "engine": "reference", "device": "cpu", "dtype": "float32"}
    assert not redis_conn.sismember("rq:workers", f"rq:worker:{worker.name}"), "a stopped worker unregisters"


def test_a_plain_rq_worker_can_run_a_wicore_job(redis_conn, tiny_model_dir, monkeypatch):
    """The job function the payload names works under RQ's own SimpleWorker too."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from wicore.worker import tasks

    monkeypatch.setenv("WICORE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("WICORE_ENGINE", "reference")
    tasks._engine.cache_clear()
    job_id = Producer(redis_conn, model=MODEL).submit(png_bytes(5), "x", params=GenerationParams(max_new_tokens=3))
    queue = Queue(Job.fetch(job_id, connection=redis_conn).origin, connection=redis_conn, serializer=JSONSerializer)
    SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer).work(burst=True)
    result = Producer(redis_conn, model=MODEL).result(job_id)
    assert result.output_tokens == 3 and result.engine == "reference"
    tasks._engine.cache_clear()


@pytest.mark.parametrize("no_cache", [False, True])
def test_worker_shares_image_embeddings_through_redis(redis_url, redis_conn, tiny_model_dir, no_cache):
    """Two questions about one image, in two batches: with caching, the second batch's image
    comes from the cache (local, filled through the Redis-shared layer); `--no-cache` encodes it again."""
    from wicore.config import load_settings
    from wicore.worker.factory import build_engine, build_worker

    settings = load_settings(redis_url=redis_url, engine="fast", batch_size=1, no_cache=no_cache, max_queue_delay_ms=0)
    engine = build_engine(settings, tiny_model_dir)
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=3)
    ids = producer.submit_many([Submission(png_bytes(9), q, params=params) for q in ("one?", "two?")])
    build_worker(settings, redis_conn, engine, MODEL, burst=True).run()
    assert all(o.result is not None for o in outcomes(producer, ids).values())
    stats = engine.stats()
    assert stats["images_encoded"] == (2 if no_cache else 1)
    engine.close()  # writes what is still queued for the shared layer (it writes behind)
    shared = [k for k in redis_conn.scan_iter("wicore:vision:*")]
    assert bool(shared) is not no_cache


def test_poison_jobs_fail_alone_at_once_and_their_batch_mates_run(redis_conn, engine):
    """Malformed records, a NUL byte in a path, image-placeholder text in a prompt: each fails its
    own job at once, never retried; the good jobs claimed beside them succeed; the worker lives."""
    import pickle

    from rq.registry import FailedJobRegistry

    from tests.helpers import payload_data, plant_job
    from wicore import keys

    producer = Producer(redis_conn, model=MODEL, config=ProducerConfig(retries=2))
    params = GenerationParams(max_new_tokens=2)
    good = producer.submit_many([Submission(png_bytes(i), f"good {i}", params=params) for i in range(3)])
    placeholder = producer.submit(png_bytes(9), "what is <start_of_image> here?", params=params)
    queue = Job.fetch(good[0], connection=redis_conn).origin
    payload = json.loads(zlib.decompress(redis_conn.hget(f"rq:job:{good[0]}", "data")))[2][0]
    nul_path = {**payload, "images": [{**payload["images"][0], "path": "/allowed/good.png\x00.txt"}]}
    ftp_url = {**payload, "images": [{"url": "ftp://host/a.png"}]}
    refused_url = {**payload, "images": [{"url": "http://127.0.0.1:9/a.png"}]}
    url_and_hash = {**payload, "images": [{**payload["images"][0], "url": "https://host/a.png"}]}
    user = {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}
    parts_only = {**payload, "prompt": None, "messages": [user]}  # two image parts, one image
    both = {**payload, "image": payload["images"][0]}
    assistant_last = {**payload, "prompt": None, "messages": [{"role": "assistant", "content": "hi"}]}
    poison = {
        plant_job(redis_conn, queue, "bad-data", good[0], data=b"{not json"): "InvalidJob: data is not JSON",
        plant_job(redis_conn, queue, "pickled-meta", good[0], meta=pickle.dumps({"a": 1})): "InvalidJob: meta",
        plant_job(redis_conn, queue, "no-data", good[0], data=None): "InvalidJob: the job hash has no data",
        plant_job(redis_conn, queue, "nul-path", good[0], data=payload_data(nul_path)): "InvalidJob: payload",
        plant_job(redis_conn, queue, "ftp-url", good[0], data=payload_data(ftp_url)): "InvalidJob: payload",
        plant_job(redis_conn, queue, "url-and-hash", good[0], data=payload_data(url_and_hash)): "InvalidJob: payload",
        # a URL the policy refuses (loopback): fails at its fetch, alone
        plant_job(redis_conn, queue, "refused-url", good[0], data=payload_data(refused_url)): "ImageFetchError: "
        "http://127.0.0.1:9/a.png: refused: 127.0.0.1 is not a public address",
        plant_job(redis_conn, queue, "parts-without-images", good[0], data=payload_data(parts_only)): "InvalidJob",
        plant_job(redis_conn, queue, "image-and-images", good[0], data=payload_data(both)): "InvalidJob",
        plant_job(redis_conn, queue, "assistant-last", good[0], data=payload_data(assistant_last)): "InvalidJob",
    }
    plant_job(redis_conn, queue, "no-hash", "nothing-here")
    more = producer.submit_many([Submission(png_bytes(10 + i), f"more {i}", params=params) for i in range(3)])
    seen_before = engine.requests_seen

    worker = run_worker(redis_conn, engine)
    assert worker.jobs_done == len(good) + len(more) + 1 + len(poison)
    results = outcomes(producer, good + more + [placeholder] + list(poison))
    for job_id in good + more:
        assert results[job_id].result is not None, results[job_id].error
    assert results[placeholder].error.startswith("JobInputError: the prompt holds 2 image placeholders")
    for job_id, says in poison.items():
        assert results[job_id].error.startswith(says), results[job_id].error
    failed = FailedJobRegistry(queue, connection=redis_conn).get_job_ids()
    assert set(failed) == set(poison) | {placeholder}, "failed at once: none went back for a retry"
    assert redis_conn.hget(f"rq:job:{placeholder}", "retries_left") == b"2"
    assert [e[b"id"] for _, e in redis_conn.xrange(keys.DEAD_LETTER)] == [b"no-hash"]
    assert engine.requests_seen - seen_before == len(good) + len(more) + 1, "each good job ran once"


def test_worker_reports_waiting_for_redis_and_carries_on_when_it_is_back(tmp_path):
    """In-process: Redis (AOF) is shut down under a running worker; its state says "waiting for
    Redis" until the server is back, then it takes the next job."""
    from tests.helpers import wait_until
    from wicore.embedded import EmbeddedRedis, free_port
    from wicore.engines.null import NullEngine
    from wicore.worker.worker_config import WorkerState

    port, data = free_port(), tmp_path / "redis"
    server = EmbeddedRedis(data, persist=True, port=port).start()
    connection = Redis.from_url(server.url)
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=4))
    worker = BatchingWorker(connection, engine, WorkerConfig(MODEL, max_jobs=2, liveness_ttl_s=3))
    producer = Producer(Redis.from_url(server.url), model=MODEL)
    first = producer.submit(png_bytes(1), "before")
    seen = []

    def outage():
        nonlocal server
        wait_until(lambda: redis_status(server, first) == b"finished", 60, what="the first job")
        server.stop()
        wait_until(lambda: worker.state is WorkerState.WAITING_FOR_REDIS, 60, what="waiting for Redis")
        seen.append(worker.state.value)
        server = EmbeddedRedis(data, persist=True, port=port).start()
        wait_until(lambda: worker.state is WorkerState.READY, 60, what="ready again")
        seen.append(worker.state.value)
        producer.submit(png_bytes(2), "after")

    try:
        assert run_beside(worker, outage) == 2
    finally:
        server.stop()
    assert seen == ["waiting for Redis", "ready"]


def run_beside(worker: BatchingWorker, client) -> int:
    """`worker.run()` here (its signal handlers need the main thread) while `client` runs in
    another thread; the jobs the worker ended."""
    helper = threading.Thread(target=client)
    helper.start()
    try:
        return worker.run()
    finally:
        helper.join(timeout=120)


def redis_status(server, job_id: str):
    with Redis.from_url(server.url) as connection:
        return connection.hget(f"rq:job:{job_id}", "status")


def recording_engine(max_batch_size: int):
    """A NullEngine that records the size of each `add`."""
    from wicore.engines.null import NullEngine

    class RecordingEngine(NullEngine):
        def __init__(self, config):
            super().__init__(config)
            self.adds: list[int] = []

        def add(self, requests):
            self.adds.append(len(requests))
            return super().add(requests)

    return RecordingEngine(EngineConfig(model_dir="", max_batch_size=max_batch_size))


def test_jobs_claimed_together_reach_the_engine_together(redis_conn):
    """Images decode at different speeds; the engine still gets each claimed batch in one `add`."""
    producer = Producer(redis_conn, model=MODEL)
    sizes = [(900, 900), (20, 20), (600, 400), (30, 30), (800, 700), (10, 10), (500, 500), (40, 40)]
    ids = producer.submit_many([Submission(png_bytes(i, size), "x") for i, size in enumerate(sizes)])
    engine = recording_engine(8)
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_s=0.0)
    BatchingWorker(redis_conn, engine, WorkerConfig(MODEL, policy=policy, burst=True)).run()
    assert all(o.result is not None for o in outcomes(producer, ids).values())
    assert engine.adds == [8]


def test_a_large_claim_reaches_the_engine_in_groups_of_its_vision_batch(redis_conn, tiny_model_dir):
    """A claim of two vision batches (the fast engine's vision_batch_size=16) goes to the engine
    as they load: the first alone (the second's images are the slowest to decode) or both at
    once, never a group split."""
    from wicore.engines.fast import FastEngine
    from wicore.engines.options import FastOptions

    class RecordingFastEngine(FastEngine):
        def add(self, requests):
            self.adds.append(len(requests))
            return super().add(requests)

    options = FastOptions(vision_batch_size=16, torch_threads=1)
    engine = RecordingFastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=64, cache=False, options=options))
    engine.adds = []
    producer = Producer(redis_conn, model=MODEL)
    sizes = [(16, 16)] * 16 + [(1500, 1500)] * 16
    params = GenerationParams(max_new_tokens=2)
    ids = producer.submit_many([Submission(png_bytes(i, size), "x", params=params) for i, size in enumerate(sizes)])
    policy = BatchPolicy(max_batch_size=64, max_queue_delay_s=0.0)  # room for the claim beside the high lane's
    try:
        BatchingWorker(redis_conn, engine, WorkerConfig(MODEL, policy=policy, burst=True)).run()
    finally:
        engine.close()
    assert all(o.result is not None for o in outcomes(producer, ids).values())
    assert engine.handover_size() == 16 and engine.adds in ([16, 16], [32])


def test_a_worker_that_goes_idle_publishes_the_counters_of_its_last_jobs(redis_conn):
    """`wicore status` reads the published stats: they show the jobs just done once the worker
    waits for more, not only at its next maintenance (an hour away here)."""
    from tests.helpers import wait_until
    from wicore.engines.null import NullEngine
    from wicore.worker.status import published_stats

    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=4))
    config = WorkerConfig(MODEL, max_jobs=5, liveness_ttl_s=3600, reap_every_s=3600)
    worker = BatchingWorker(redis_conn, engine, config)
    producer = Producer(redis_conn, model=MODEL)
    seen = []

    def client():
        ids = producer.submit_many([Submission(png_bytes(i), "x") for i in range(4)])
        try:
            assert all(o.result is not None for o in outcomes(producer, ids).values())
            wait_until(lambda: published_stats(redis_conn, worker.name).get("jobs_done") == 4, 30, what="4 jobs")
            seen.append(published_stats(redis_conn, worker.name)["in_flight"])
        finally:
            producer.submit(png_bytes(9), "the fifth ends the run")

    assert run_beside(worker, client) == 5
    assert seen == [0]
