"""Admission control: past a lane's cap of queued jobs the Producer raises QueueFull and the gateway
answers 429 with Retry-After in OpenAI's error shape (native jobs and chat alike), while the high
lane, with its own cap, still takes work; refusals are counted on /metrics."""

from __future__ import annotations

import base64
import signal
from contextlib import ExitStack

import httpx
import pytest

from tests.helpers import metric_total, png_bytes, scrape_metrics, start_gateway, stop, wait_http
from wicore.embedded import free_port
from wicore.errors import QueueFull
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.schemas import Lane

openai = pytest.importorskip("openai")  # the test extra; absent on a bare GPU image

MODEL = "admit"
CAP = 5


def test_the_producer_refuses_past_the_cap_and_the_high_lane_keeps_its_own(redis_conn):
    producer = Producer(redis_conn, model=MODEL, config=ProducerConfig(max_queued_jobs=CAP, max_queued_high_jobs=2))
    producer.submit_many([Submission(png_bytes(i), "fill") for i in range(CAP)])
    with pytest.raises(QueueFull) as refused:
        producer.submit(png_bytes(99), "one too many")
    assert (refused.value.lane, refused.value.queued, refused.value.cap) == ("normal", CAP, CAP)
    assert refused.value.retry_after_s >= 1
    assert producer.submit(png_bytes(0), "fill") is not None, "the same work again adds nothing: admitted"
    producer.submit(png_bytes(100), "urgent", priority=Lane.HIGH)
    producer.submit(png_bytes(101), "urgent", priority=Lane.HIGH)
    with pytest.raises(QueueFull):
        producer.submit(png_bytes(102), "urgent", priority=Lane.HIGH)


@pytest.mark.slow
def test_the_gateway_answers_429_with_retry_after_past_the_cap(tmp_path, redis_url):
    port = free_port()
    env = {"WICORE_MAX_QUEUED_JOBS": str(CAP), "WICORE_MAX_QUEUED_HIGH_JOBS": "10"}
    url = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:  # no worker: the queue only grows
        gateway = start_gateway("--redis-url", redis_url, "--port", str(port), "--model-id", MODEL, env=env,
                                log=tmp_path / "gw.log")  # fmt: skip
        stack.callback(stop, gateway, signal.SIGTERM)
        wait_http(url + "/health/live", 60, gateway)
        with httpx.Client(base_url=url, timeout=30) as http:
            accepted = [http.post("/v1/jobs", json=job(i)).status_code for i in range(CAP)]
            refused = http.post("/v1/jobs", json=job(CAP))
            high = http.post("/v1/jobs", json=job(CAP + 1, priority="high"))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as chat:
            client.chat.completions.create(model=MODEL, messages=chat_messages(), max_tokens=4)
        samples = scrape_metrics(url + "/metrics")
    assert accepted == [202] * CAP
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == 429 and "cap of 5" in error["message"]
    assert high.status_code == 202, "the high lane keeps its own headroom"
    assert chat.value.status_code == 429 and chat.value.response.headers["Retry-After"]
    assert metric_total(samples, "wicore:jobs_refused_total", model_name=MODEL, lane="normal") == 2


def job(i: int, priority: str = "normal") -> dict:
    return {"image": base64.b64encode(png_bytes(i)).decode(), "prompt": f"job {i}", "priority": priority}


def chat_messages() -> list[dict]:
    image = "data:image/png;base64," + base64.b64encode(png_bytes(500)).decode()
    parts = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": image}}]
    return [{"role": "user", "content": parts}]


@pytest.mark.slow
def test_enqueue_waits_at_the_cap_and_goes_on_as_a_worker_drains(tmp_path, redis_url):
    """A lane holding its cap: `wicore enqueue` says it waits, and enqueues everything once a
    worker has drained the lane (an oversized first submission goes into the empty lane)."""
    from tests.helpers import start_cli, start_worker, wait_until, wicore, write_images

    write_images(tmp_path / "first", 6)
    write_images(tmp_path / "second", 6, start=6)
    env = {"WICORE_MAX_QUEUED_JOBS": "4"}
    common = ["--redis-url", redis_url, "--model-id", MODEL]
    wicore("enqueue", str(tmp_path / "first"), *common, env=env)
    log = tmp_path / "enqueue.log"
    with ExitStack() as stack:
        waiting = start_cli("enqueue", str(tmp_path / "second"), *common, env=env, log=log)
        stack.callback(stop, waiting)
        wait_until(lambda: "waiting: model" in log.read_text(), 60, what="enqueue to say it waits")
        worker = start_worker(*common, "--engine", "null", "--batch-size", "2", log=tmp_path / "worker.log")
        stack.callback(stop, worker)
        assert waiting.wait(timeout=120) == 0
    said = log.read_text()
    assert f"waiting: model {MODEL}'s normal lane has 6 queued jobs, at its cap of 4" in said
    assert len([line for line in said.splitlines() if "\t" in line]) == 6, "every input enqueued in the end"
