"""rq-dashboard, mounted by `wicore dashboard`, reads wicore's JSON jobs: its JSON endpoints list
the bucket queues, a live worker, and the finished and failed jobs."""

from __future__ import annotations

import pytest

from tests.helpers import png_bytes
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker, WorkerConfig
from wicore.worker.rq_bridge import RQWorkerRecord

pytest.importorskip("rq_dashboard")


def test_dashboard_lists_queues_workers_and_jobs(redis_conn, redis_url):
    from rq.serializers import JSONSerializer

    from wicore.worker.dashboard import make_app

    producer = Producer(redis_conn, model="dash")
    ok = producer.submit(png_bytes(1), "fine")
    bad = producer.submit(b"not an image", "broken")
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=8))
    BatchingWorker(redis_conn, engine, WorkerConfig("dash", policy=BatchPolicy(max_queue_delay_s=0), burst=True)).run()
    live = RQWorkerRecord([], name="dash-worker", connection=redis_conn, serializer=JSONSerializer)
    live.register_birth()

    client = make_app(redis_url).test_client()
    queues = client.get("/0/data/queues.json").get_json()["queues"]
    [queue] = [q for q in queues if q["name"].startswith("wicore.dash.")]
    workers = client.get("/0/data/workers.json").get_json()["workers"]
    assert "dash-worker" in [w["name"] for w in workers]

    name = queue["name"]
    finished = client.get(f"/0/data/jobs/{name}/finished/8/asc/1.json").get_json()["jobs"]
    failed = client.get(f"/0/data/jobs/{name}/failed/8/asc/1.json").get_json()["jobs"]
    assert [j["id"] for j in finished] == [ok]
    assert [j["id"] for j in failed] == [bad]
    detail = client.get(f"/0/data/job/{bad}.json").get_json()
    assert "ImageError" in detail["exc_info"]
