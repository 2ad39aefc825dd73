"""Streamed answers end to end: a real `wicore serve`, a real redis-server and a CPU worker (fast
engine) on the bundled demo captioner, read with the official `openai` client and httpx.

Each of the six example captions streams in several chunks that add up to the non-streamed
text; `include_usage` adds the usage chunk; a client that closes its stream leaves its job
canceled; the native GET /v1/jobs/{id}/stream sends text events then the job; /v1/completions
answers whole and streamed; GET /v1/models/{id}; every malformed new field is a 400 naming it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import time

import httpx
import pytest
from redis import Redis

from tests.helpers import served_with_a_worker, start_gateway, start_worker, stop, wait_http, wait_until
from tests.test_gateway_chat import IMAGES, MODEL, TEXT, caption_of, image_part
from wicore import keys
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gateway URL, Redis URL, worker process) with one fast-engine worker."""
    with served_with_a_worker(tmp_path_factory.mktemp("logs")) as served:
        yield served.url, served.redis_url, served.worker


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120)


def chat(image, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [image_part(image), TEXT]}], **fields}


def test_each_caption_streams_in_several_chunks_that_add_up_to_the_whole_answer(client):
    for image in IMAGES:
        chunks = list(client.chat.completions.create(**chat(image, max_tokens=24, stream=True)))
        whole = client.chat.completions.create(**chat(image, max_tokens=24))
        assert chunks[0].choices[0].delta.role == "assistant"
        texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(texts) >= 3, texts
        assert "".join(texts) == whole.choices[0].message.content == caption_of(image)
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_include_usage_adds_a_last_chunk_of_no_choices_with_the_usage(client):
    image = IMAGES[0]
    chunks = list(
        client.chat.completions.create(
            **chat(image, max_tokens=24, stream=True, stream_options={"include_usage": True})
        )
    )
    whole = client.chat.completions.create(**chat(image, max_tokens=24))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "stop"


def test_asked_for_logprobs_the_last_chunk_carries_every_tokens(client):
    image = IMAGES[1]
    fields = {"max_tokens": 24, "logprobs": True, "top_logprobs": 2}
    chunks = list(client.chat.completions.create(**chat(image, stream=True, **fields)))
    whole = client.chat.completions.create(**chat(image, **fields)).choices[0].logprobs.content
    *text_chunks, last = chunks
    assert all(c.choices[0].logprobs is None for c in text_chunks)
    streamed = last.choices[0].logprobs.content
    assert last.choices[0].finish_reason == "stop" and [t.token for t in streamed] == [t.token for t in whole]
    assert all(len(t.top_logprobs) == 2 for t in streamed)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "".join(t.token for t in streamed).startswith(text), "the tokens spell the text (then the stop token)"


def test_a_client_that_closes_its_stream_midway_leaves_its_job_canceled(client, served):
    fields = chat(IMAGES[1], max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(**fields)
    seen = [chunk for chunk, _ in zip(stream, range(4), strict=False)]
    stream.close()
    job_id = seen[0].id.removeprefix("chatcmpl-")
    status = lambda: httpx.get(f"{served[0]}/v1/jobs/{job_id}").json()["status"]  # noqa: E731
    wait_until(lambda: status() == "canceled", 30, 0.1, "the job canceled")


def test_the_native_stream_sends_text_events_then_the_job(served):
    url, redis_url, _ = served
    job = {"messages": native_messages(IMAGES[2]), "params": {"max_new_tokens": 24, "stream": True}}
    accepted = httpx.post(f"{url}/v1/jobs", json=job).json()
    events = read_events(f"{url}/v1/jobs/{accepted['job_id']}/stream")
    texts = [data["text"] for name, data in events if name == "text"]
    name, view = events[-1]
    assert name == "end" and view["status"] == "finished" and "".join(texts) == view["result"]["text"]
    assert len(texts) >= 2 and view["result"]["text"] == caption_of(IMAGES[2])
    with Redis.from_url(redis_url) as redis:
        assert 0 < redis.xlen(keys.tokens(accepted["job_id"])) <= 24 and redis.ttl(keys.tokens(accepted["job_id"])) > 0


def test_a_job_that_does_not_stream_writes_no_token_stream_and_streams_whole(served):
    url, redis_url, _ = served
    accepted = httpx.post(f"{url}/v1/jobs", json={"messages": native_messages(IMAGES[3])}).json()
    events = read_events(f"{url}/v1/jobs/{accepted['job_id']}/stream")
    assert [name for name, _ in events] == ["text", "end"] and events[0][1]["text"] == caption_of(IMAGES[3])
    with Redis.from_url(redis_url) as redis:
        assert not redis.exists(keys.tokens(accepted["job_id"]))


def native_messages(image) -> list[dict]:
    data = base64.b64encode(image.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image", "image": data}, TEXT]}]


def read_events(url: str) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent event stream, read to its end."""
    events, name = [], "message"
    with httpx.stream("GET", url, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = "message"
    return events


def test_text_completions_answer_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt="Name a colour.", max_tokens=8)
    assert whole.object == "text_completion" and whole.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt="Name a colour.", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_model_is_read_by_its_id_and_an_unknown_one_is_a_404(client, served):
    assert client.models.retrieve(MODEL).id == MODEL
    reply = httpx.get(f"{served[0]}/v1/models/no-such-model")
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
        ("chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ("chat/completions", {"stream": True, "stream_options": {"usage": True}}, "stream_options"),
        ("chat/completions", {"stream": "often"}, "stream"),
        ("completions", {"prompt": ["one", "two"]}, "prompt"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"prompt": 7}, "prompt"),
    ],
)
def test_a_malformed_or_unsupported_field_is_a_400_naming_it(served, route, fields, param):
    base = chat(IMAGES[0]) if route == "chat/completions" else {"model": MODEL, "prompt": "Hi."}
    reply = httpx.post(f"{served[0]}/v1/{route}", json={**base, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].split(".")[0] == param, reply.json()


@pytest.fixture(scope="module")
def reference_served(tmp_path_factory):
    """A gateway with one reference-engine worker (it streams at the end of its batch)."""
    logs = tmp_path_factory.mktemp("reference-logs")
    with EmbeddedRedis() as redis_server:
        metrics_port, port = free_port(), free_port()
        worker = start_worker("--redis-url", redis_server.url, "--engine", "reference", "--metrics-port",
                              str(metrics_port), log=logs / "worker.log")  # fmt: skip
        gateway = start_gateway("--redis-url", redis_server.url, "--port", str(port), log=logs / "gateway.log")
        try:
            wait_http(f"http://127.0.0.1:{metrics_port}/metrics", 120, worker)
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health/live", 60, gateway)
            wait_until(lambda: httpx.get(url + "/health/ready").status_code == 200, 60, 0.2, "a ready gateway")
            yield url
        finally:
            stop(gateway)
            stop(worker, signal.SIGKILL)


def test_the_reference_engine_streams_its_text_whole_at_the_end(reference_served):
    import openai

    client = openai.OpenAI(base_url=reference_served + "/v1", api_key="unused", timeout=120)
    image = IMAGES[4]
    chunks = list(client.chat.completions.create(**chat(image, max_tokens=24, stream=True)))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts == [caption_of(image)] and chunks[-1].choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def short_timeout_gateway(served, tmp_path_factory):
    """A second gateway on the same Redis and worker: request_timeout_s 2 s, stream_idle_timeout_s
    3 s, and a client leaving its stream does not cancel its job."""
    port = free_port()
    log = tmp_path_factory.mktemp("short") / "gateway.log"
    env = {"WICORE_REQUEST_TIMEOUT_S": "2", "WICORE_STREAM_IDLE_TIMEOUT_S": "3",
           "WICORE_STREAM_CANCEL_ON_DISCONNECT": "false"}  # fmt: skip
    gateway = start_gateway("--redis-url", served[1], "--port", str(port), env=env, log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health/ready", 60, gateway)
        openai_client(url).chat.completions.create(**chat(IMAGES[0], max_tokens=4))  # a warm worker
        yield url
    finally:
        stop(gateway)


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)


@contextlib.contextmanager
def frozen(worker):
    """The worker stopped (SIGSTOP) for the block's length, then continued."""
    worker.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.send_signal(signal.SIGCONT)


LONG = {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}


def test_a_stream_has_no_request_timeout_ceiling_while_text_flows(served, short_timeout_gateway):
    """Four 0.7 s freezes of the worker mid-stream: the stream lasts past request_timeout_s (2 s),
    never idle for stream_idle_timeout_s (3 s), and ends whole."""
    stream = openai_client(short_timeout_gateway).chat.completions.create(**chat(IMAGES[5], stream=True, **LONG))
    started, chunks = time.monotonic(), []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) in (5, 10, 15, 20):
            with frozen(served[2]):
                time.sleep(0.7)
    assert time.monotonic() - started > 2.8 and chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_idle_past_its_limit_ends_with_an_error_naming_it(served, short_timeout_gateway):
    import openai

    stream = openai_client(short_timeout_gateway).chat.completions.create(**chat(IMAGES[4], stream=True, **LONG))
    with pytest.raises(openai.APIError, match="stream_idle_timeout_s") as ended:
        for index, _ in enumerate(stream):
            if index == 3:
                served[2].send_signal(signal.SIGSTOP)
    served[2].send_signal(signal.SIGCONT)
    assert "GET /v1/jobs/" in str(ended.value)


def test_a_whole_answer_past_request_timeout_is_a_504_naming_its_job(served, short_timeout_gateway):
    import openai

    with frozen(served[2]), pytest.raises(openai.APIStatusError) as whole:
        openai_client(short_timeout_gateway).chat.completions.create(**chat(IMAGES[3], max_tokens=8))
    assert whole.value.status_code == 504 and "GET /v1/jobs/" in whole.value.message


def test_with_cancel_on_disconnect_off_a_closed_stream_leaves_its_job_running(short_timeout_gateway):
    stream = openai_client(short_timeout_gateway).chat.completions.create(**chat(IMAGES[2], stream=True, **LONG))
    seen = [chunk for chunk, _ in zip(stream, range(4), strict=False)]
    stream.close()
    job = f"{short_timeout_gateway}/v1/jobs/{seen[0].id.removeprefix('chatcmpl-')}"
    view = httpx.get(job, params={"wait": 60}).json()
    assert view["status"] == "finished" and view["result"]["output_tokens"] == LONG["max_tokens"], view
