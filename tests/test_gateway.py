"""`wicore serve` end to end: a real uvicorn server on a loopback port, a real redis-server and a
CPU worker (fast engine) on the bundled demo captioner, whose captions of examples/images are
their file names. Submit by JSON, multipart and batch; long-poll; cancel queued and running
jobs; the OpenAI client; API keys; metrics; readiness (tests/test_docs.py runs the README's examples)."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import metric_total, scrape_metrics, start_gateway, start_worker, stop, wait_http, wait_until
from tests.url_servers import image_http_server
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "examples" / "images"
MODEL = "democap"
KEYS = ("key-one", "key-two")
LONG = {"max_new_tokens": 1500, "ignore_eos": True}  # seconds of decoding on a CPU


def caption_of(path: Path) -> str:
    """'red-star-on-purple.png' -> 'a red star on a purple background' (the demo captioner's form)."""
    color, shape, _, background = path.stem.split("-")
    article = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    """Two sequences at a time, so a third job waits in its queue; dies in the last test."""
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    process = start_worker(
        "--redis-url",
        redis_server.url,
        "--engine",
        "fast",
        "--engine-option",
        "torch_threads=1",
        "--batch-size",
        "2",
        "--metrics-port",
        str(metrics_port),
        "--allow-root",
        str(IMAGES),
        # short liveness, for the readiness test (heartbeats every 1.3 s); the image server on loopback
        env={"WICORE_LIVENESS_TTL_S": "4", "WICORE_URL_ALLOW_HOSTS": "127.0.0.1", "WICORE_URL_TIMEOUT_S": "5"},
        log=log,
    )
    wait_http(f"http://127.0.0.1:{metrics_port}/metrics", 120, process)
    yield process, metrics_port
    stop(process, signal.SIGKILL)


def gateway_process(redis_url: str, tmp_path_factory, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = start_gateway(
        "--redis-url", redis_url, "--port", str(port), "--allow-root", str(IMAGES), env=env, log=log
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/live", 60, process)
    return process, url


@pytest.fixture(scope="module")
def gateway(redis_server, worker, tmp_path_factory):
    process, url = gateway_process(redis_server.url, tmp_path_factory)
    wait_until(lambda: httpx.get(url + "/health/ready").status_code == 200, 60, 0.2, "a ready gateway")
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client
    stop(process)


@pytest.fixture(scope="module")
def keyed(redis_server, worker, tmp_path_factory):
    """A second gateway on the same Redis, with API keys from the environment."""
    process, url = gateway_process(redis_server.url, tmp_path_factory, env={"WICORE_API_KEYS": ",".join(KEYS)})
    yield url
    stop(process)


def wait_job(client: httpx.Client, job_id: str, seconds: float = 60) -> dict:
    reply = client.get(f"/v1/jobs/{job_id}", params={"wait": seconds})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_json_submit_and_long_poll(gateway):
    image = IMAGES / "red-star-on-purple.png"
    reply = gateway.post("/v1/jobs", json={"image": b64(image)})
    assert reply.status_code == 202, reply.text
    accepted = reply.json()
    assert accepted["status_url"] == f"/v1/jobs/{accepted['job_id']}" and accepted["model"] == MODEL
    done = wait_job(gateway, accepted["job_id"])
    assert done["status"] == "finished" and done["result"]["text"] == caption_of(image)
    as_data_uri = gateway.post("/v1/jobs", json={"image": f"data:image/png;base64,{b64(image)}"})
    by_path = gateway.post("/v1/jobs", json={"image_path": str(image)})
    assert as_data_uri.json()["job_id"] == by_path.json()["job_id"] == accepted["job_id"], "same work, same id"


def test_multipart_upload(gateway):
    image = IMAGES / "white-cross-on-red.jpg"
    files = {"image": (image.name, image.read_bytes(), "image/jpeg")}
    reply = gateway.post("/v1/jobs", files=files, data={"params": json.dumps({"max_new_tokens": 16})})
    assert reply.status_code == 202, reply.text
    assert wait_job(gateway, reply.json()["job_id"])["result"]["text"] == caption_of(image)


def test_batch_json_list_with_a_bad_line(gateway):
    images = sorted(IMAGES.iterdir())
    body = [{"image": b64(p), "params": {"max_new_tokens": 20}} for p in images]
    body.insert(2, {"image": b64(images[0]), "params": {"max_new_tokens": 0}})
    reply = gateway.post("/v1/jobs/batch", json=body)
    assert reply.status_code == 202, reply.text
    lines = reply.json()["jobs"]
    assert [line["index"] for line in lines] == list(range(len(body)))
    assert lines[2]["job_id"] is None and "max_new_tokens" in lines[2]["error"]
    good = [line for line in lines if line["job_id"]]
    assert reply.json()["accepted"] == len(good) == len(images)
    for path, line in zip(images, good):
        assert wait_job(gateway, line["job_id"])["result"]["text"] == caption_of(path)


def test_batch_openai_jsonl(gateway):
    images = sorted(IMAGES.iterdir())[:3]
    lines = [
        json.dumps(
            {"custom_id": p.stem, "method": "POST", "url": "/v1/chat/completions", "body": chat_body(p, max_tokens=24)}
        )
        for p in images
    ]
    lines.append("{not json")
    reply = gateway.post("/v1/jobs/batch", content="\n".join(lines), headers={"content-type": "application/jsonl"})
    assert reply.status_code == 202, reply.text
    jobs = reply.json()["jobs"]
    assert [j["custom_id"] for j in jobs[:3]] == [p.stem for p in images]
    assert jobs[3]["job_id"] is None and "line 4 is not valid JSON" in jobs[3]["error"]
    for path, job in zip(images, jobs):
        assert wait_job(gateway, job["job_id"])["result"]["text"] == caption_of(path)


def chat_body(image: Path, **fields) -> dict:
    mime = "image/png" if image.suffix == ".png" else "image/jpeg"
    content = [
        {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(image)}"}},
        {"type": "text", "text": "Describe this image in detail."},
    ]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def test_openai_client(gateway):
    import openai

    client = openai.OpenAI(base_url=str(gateway.base_url) + "/v1", api_key="unused")
    image = IMAGES / "yellow-triangle-on-orange.jpg"
    body = chat_body(image, max_tokens=32)
    reply = client.chat.completions.create(model=body["model"], messages=body["messages"], max_tokens=32)
    assert reply.choices[0].message.content == caption_of(image)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens > 0
    assert [m.id for m in client.models.list()] == [MODEL]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools: tool calls are not supported"):
        client.chat.completions.create(model=MODEL, messages=body["messages"], tools=[tool])
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="no-such-model", messages=body["messages"])


@pytest.fixture(scope="module")
def image_server():
    with image_http_server() as base:
        yield base


def test_images_by_url_are_fetched_by_the_worker(gateway, image_server):
    import openai

    image = IMAGES / "red-star-on-purple.png"
    reply = gateway.post("/v1/jobs", json={"image_url": f"{image_server}/img/{image.name}"})
    assert reply.status_code == 202, reply.text
    assert wait_job(gateway, reply.json()["job_id"])["result"]["text"] == caption_of(image)

    client = openai.OpenAI(base_url=str(gateway.base_url) + "/v1", api_key="unused")
    other = IMAGES / "white-cross-on-red.jpg"
    content = [
        {"type": "image_url", "image_url": {"url": f"{image_server}/to-img/{other.name}"}},
        {"type": "text", "text": "Describe this image in detail."},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert answer.choices[0].message.content == caption_of(other)
    content[0] = {"type": "image_url", "image_url": {"url": f"{image_server}/missing"}}
    with pytest.raises(openai.BadRequestError, match=r"ImageFetchError: http://127\.0\.0\.1:\d+/missing: HTTP 404"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])

    missing = gateway.post("/v1/jobs", json={"image_url": f"{image_server}/missing?token=abc"}).json()["job_id"]
    ended = wait_job(gateway, missing)
    assert ended["status"] == "failed"
    assert ended["error"] == f"ImageFetchError: {image_server}/missing?token=***: HTTP 404 Not Found"


def test_cancel_a_queued_and_a_running_job(gateway, redis_server):
    """The worker runs two sequences at a time: two long jobs fill it, a third waits in its
    queue. Canceling the third means it never runs; canceling a running one leaves its batch
    mate running to its full length."""
    from redis import Redis

    images = sorted(IMAGES.iterdir())
    running = [gateway.post("/v1/jobs", json={"image": b64(p), "params": LONG}).json()["job_id"] for p in images[:2]]
    status = lambda job_id: gateway.get(f"/v1/jobs/{job_id}").json()["status"]  # noqa: E731
    wait_until(lambda: all(status(j) == "started" for j in running), 60, 0.05, "two running jobs")
    queued = gateway.post("/v1/jobs", json={"image": b64(images[2]), "params": {"seed": 7}}).json()["job_id"]
    assert status(queued) == "queued"

    assert gateway.delete(f"/v1/jobs/{queued}").json() == {"job_id": queued, "status": "canceled"}
    assert gateway.delete(f"/v1/jobs/{running[0]}").json()["status"] == "canceled"
    canceled = wait_job(gateway, running[0], 5)
    assert canceled["status"] == "canceled" and canceled["error"].startswith("JobCanceled")

    mate = wait_job(gateway, running[1], 120)
    assert mate["status"] == "finished" and mate["result"]["output_tokens"] == LONG["max_new_tokens"]
    connection = Redis.from_url(redis_server.url)
    assert not connection.hget(f"rq:job:{queued}", "worker_name"), "no worker ever took the queued job"
    assert wait_job(gateway, queued, 1)["status"] == "canceled"
    assert connection.xlen(f"rq:results:{queued}") == connection.xlen(f"rq:results:{running[0]}") == 0
    assert gateway.delete(f"/v1/jobs/{running[1]}").json()["status"] == "finished", "an ended job stays ended"


def test_api_keys(keyed):
    image = IMAGES / "orange-circle-on-red.png"
    body = {"image": b64(image)}
    assert httpx.post(keyed + "/v1/jobs", json=body).status_code == 401
    wrong = httpx.post(keyed + "/v1/jobs", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
    assert "nope" not in wrong.text and KEYS[0] not in wrong.text
    assert httpx.get(keyed + "/v1/models").status_code == 401
    ok = httpx.post(keyed + "/v1/jobs", json=body, headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert ok.status_code == 202
    assert httpx.get(keyed + "/health/live").status_code == 200, "probes stay open"
    with httpx.Client(base_url=keyed, timeout=120, headers={"Authorization": f"Bearer {KEYS[1]}"}) as client:
        # it ends here, not inside a later test's count of the worker's jobs
        assert wait_job(client, ok.json()["job_id"])["status"] == "finished"


def test_metrics_count_the_jobs_of_a_run(gateway, worker):
    worker_url = f"http://127.0.0.1:{worker[1]}/metrics"
    wait_until(
        lambda: metric_total(scrape_metrics(worker_url), "wicore:num_requests_running") == 0, 60, 0.2, "an idle worker"
    )
    before, gateway_before = scrape_metrics(worker_url), scrape_metrics(str(gateway.base_url) + "/metrics")
    seed = int(time.time())  # new work: the ids differ from every earlier test's
    ids = [
        gateway.post("/v1/jobs", json={"image": b64(p), "params": {"seed": seed + i}}).json()["job_id"]
        for i, p in enumerate(sorted(IMAGES.iterdir()))
    ]
    ended = [wait_job(gateway, job_id) for job_id in ids]
    assert [job["status"] for job in ended] == ["finished"] * len(ids), ended
    after, gateway_after = scrape_metrics(worker_url), scrape_metrics(str(gateway.base_url) + "/metrics")

    def delta(name: str, new: dict = after, old: dict = before, **labels) -> float:
        return metric_total(new, name, **labels) - metric_total(old, name, **labels)

    assert delta("wicore:request_success_total", model_name=MODEL) == len(ids)
    assert delta("wicore:e2e_request_latency_seconds_count") == len(ids)
    assert delta("wicore:images_processed_total") == len(ids)
    assert delta("wicore:request_failure_total") == delta("wicore:request_canceled_total") == 0
    gw = {"new": gateway_after, "old": gateway_before}
    assert delta("wicore:http_requests_total", handler="/v1/jobs", method="POST", status="202", **gw) == len(ids)
    assert delta("wicore:jobs_submitted_total", model_name=MODEL, **gw) == len(ids)
    assert metric_total(gateway_after, "wicore:workers", model_name=MODEL) == 1
    assert metric_total(gateway_after, "wicore:queue_jobs", status="finished") >= len(ids)


def test_docs_and_openapi(gateway):
    assert gateway.get("/docs").status_code == 200
    schemas = gateway.get("/openapi.json").json()["components"]["schemas"]
    assert {"JobRequest", "ChatCompletionRequest", "JobView", "GenerationParams", "OpenAIBatchLine"} <= set(schemas)


def test_ready_turns_503_when_the_worker_dies(gateway, worker):
    """Last in this module: it kills the module's worker (its key expires after liveness_ttl_s = 4 s)."""
    assert gateway.get("/health/ready").status_code == 200
    stop(worker[0], signal.SIGKILL)
    wait_until(lambda: gateway.get("/health/ready").status_code == 503, 30, 0.2, "readiness to drop")
    reply = gateway.get("/health/ready").json()
    assert "no live worker serves model democap" in reply["reason"]
    assert gateway.get("/health/live").status_code == 200
