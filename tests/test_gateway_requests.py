"""Bad requests against a real `wicore serve` (uvicorn on a loopback port, a real redis-server):
each gets a 4xx in OpenAI's error shape whose message names what to fix, and the server keeps
serving. No worker is needed: nothing here gets past validation."""

from __future__ import annotations

import base64
import io
import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.helpers import png_bytes, start_gateway, stop, wait_http
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "examples" / "images"
MAX_REQUEST = 400_000
MAX_IMAGE = 100_000
GOOD_IMAGE = base64.b64encode(png_bytes(1)).decode()
MODEL = "democap"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with EmbeddedRedis() as redis_server:
        port = free_port()
        env = {"WICORE_MAX_REQUEST_BYTES": str(MAX_REQUEST), "WICORE_MAX_IMAGE_BYTES": str(MAX_IMAGE)}
        log = tmp_path_factory.mktemp("gw") / "gateway.log"
        process = start_gateway(
            "--redis-url", redis_server.url, "--port", str(port), "--allow-root", str(IMAGES), env=env, log=log
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health/live", 60, process)
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client
        assert stop(process) in (0, -signal.SIGTERM), log.read_text()[-3000:]  # uvicorn re-raises SIGTERM


def raw(body: bytes, content_type: str = "application/json") -> dict:
    """A body sent as bytes under `content_type`."""
    return {"content": body, "headers": {"content-type": content_type}}


def job(**fields) -> dict:
    return {"image": GOOD_IMAGE, **fields}


def chat(content=None, **fields) -> dict:
    parts = (
        content
        if content is not None
        else [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{GOOD_IMAGE}"}},
            {"type": "text", "text": "Describe this image."},
        ]
    )
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], **fields}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def multipart(fields: dict, with_image: bool = True) -> dict:
    """A multipart/form-data body: the fields as text parts, and the image as a file part."""
    parts = {name: (None, value) for name, value in fields.items()}
    if with_image:
        parts["image"] = ("x.png", io.BytesIO(png_bytes(2)), "image/png")
    return {"files": parts}


# (method, path, request kwargs for httpx, expected status, words the message must contain)
CASES = [
    (
        "POST",
        "/v1/jobs",
        raw(b"{not json"),
        400,
        "not valid JSON",
    ),
    ("POST", "/v1/jobs", raw(b""), 400, "empty"),
    ("POST", "/v1/jobs", {"json": [1, 2]}, 400, "request body: Input should be a valid dictionary"),
    ("POST", "/v1/jobs", {"json": "a string"}, 400, "valid dictionary"),
    ("POST", "/v1/jobs", {"json": 42}, 400, "valid dictionary"),
    ("POST", "/v1/jobs", {"json": {}}, 400, "a job needs a prompt, messages or an image"),
    ("POST", "/v1/jobs", {"json": job(image_path="/x.png")}, 400, "at most one of image"),
    ("POST", "/v1/jobs", {"json": job(colour="red")}, 400, "colour"),
    ("POST", "/v1/jobs", {"json": {"image": "%%%not base64%%%"}}, 400, "not valid base64"),
    ("POST", "/v1/jobs", {"json": {"image": "data:image/png,abcd"}}, 400, "data URI"),
    ("POST", "/v1/jobs", {"json": {"image": ""}}, 400, "empty"),
    ("POST", "/v1/jobs", {"json": {"image": 12345}}, 400, "image"),
    ("POST", "/v1/jobs", {"json": job(params={"max_new_tokens": 0})}, 400, "params.max_new_tokens"),
    ("POST", "/v1/jobs", {"json": job(params={"max_new_tokens": 10**6})}, 400, "params.max_new_tokens"),
    ("POST", "/v1/jobs", {"json": job(params={"max_new_tokens": "many"})}, 400, "params.max_new_tokens"),
    ("POST", "/v1/jobs", {"json": job(params={"temperature": -1})}, 400, "params.temperature"),
    ("POST", "/v1/jobs", {"json": job(params={"top_p": 0})}, 400, "params.top_p"),
    ("POST", "/v1/jobs", {"json": job(params={"top_k": -3})}, 400, "params.top_k"),
    ("POST", "/v1/jobs", {"json": job(params={"seed": -1})}, 400, "params.seed"),
    ("POST", "/v1/jobs", {"json": job(params={"stop": [""]})}, 400, "stop strings must be non-empty"),
    ("POST", "/v1/jobs", {"json": job(params={"beams": 4})}, 400, "params.beams"),
    ("POST", "/v1/jobs", {"json": job(params=[1])}, 400, "params"),
    ("POST", "/v1/jobs", {"json": job(priority="urgent")}, 400, "priority"),
    ("POST", "/v1/jobs", {"json": job(model="has spaces")}, 400, "model"),
    ("POST", "/v1/jobs", {"json": job(model="m" * 80)}, 400, "model"),
    ("POST", "/v1/jobs", {"json": job(model="nobody-serves-this")}, 404, "not served by any live worker"),
    ("POST", "/v1/jobs", {"json": job(deadline="tomorrow")}, 400, "deadline"),
    ("POST", "/v1/jobs", {"json": job(metadata=[1, 2])}, 400, "metadata"),
    (
        "POST",
        "/v1/jobs",
        {"json": job(prompt="a", messages=[{"role": "user", "content": [{"type": "image"}]}])},
        400,
        "either prompt or messages",
    ),
    ("POST", "/v1/jobs", {"json": job(messages=[{"role": "user", "content": "no image"}])}, 400, "no image part"),
    (
        "POST",
        "/v1/jobs",
        {"json": job(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])},
        400,
        "messages.0.content.1: the image part names no image",
    ),
    ("POST", "/v1/jobs", {"json": {"messages": []}}, 400, "messages: give at least one turn"),
    (
        "POST",
        "/v1/jobs",
        {"json": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}},
        400,
        "messages: the last turn must be the user's",
    ),
    (
        "POST",
        "/v1/jobs",
        {"json": {"messages": [{"role": "user", "content": [{"type": "image", "image": "%%%"}]}]}},
        400,
        "messages.0.content.0.image",
    ),
    (
        "POST",
        "/v1/jobs",
        {"json": {"messages": [{"role": "user", "content": [{"type": "image", "image": "x", "image_path": "/x"}]}]}},
        400,
        "at most one of image, image_path and image_url",
    ),
    (
        "POST",
        "/v1/jobs",
        {"json": {"messages": [{"role": "user", "content": [{"type": "image", "image": GOOD_IMAGE}] * 9}]}},
        400,
        "max_images_per_request",
    ),
    (
        "POST",
        "/v1/jobs",
        {"json": {"params": {"max_new_tokens": 3}}},
        400,
        "a job needs a prompt, messages or an image",
    ),
    ("POST", "/v1/jobs", {"json": job(messages=[{"role": "robot", "content": "hi"}])}, 400, "messages.0.role"),
    ("POST", "/v1/jobs", {"json": job(prompt=7)}, 400, "prompt"),
    ("POST", "/v1/jobs", {"json": {"image_path": "relative/x.png"}}, 400, "not a valid absolute path"),
    ("POST", "/v1/jobs", {"json": {"image_path": "/etc/passwd"}}, 400, "outside the allowed roots"),
    ("POST", "/v1/jobs", {"json": {"image_path": str(IMAGES / ".." / "make_images.py")}}, 400, "outside the allowed"),
    ("POST", "/v1/jobs", {"json": {"image_path": str(IMAGES / "missing.png")}}, 400, "cannot read"),
    ("POST", "/v1/jobs", {"json": {"image_path": "/tmp/\u0000x.png"}}, 400, "image_path"),
    ("POST", "/v1/jobs", {"json": {"image": base64.b64encode(b"x" * (MAX_IMAGE + 1)).decode()}}, 413, "limit"),
    (
        "POST",
        "/v1/jobs",
        raw(b"x" * (MAX_REQUEST + 1)),
        413,
        "max_request_bytes",
    ),
    ("POST", "/v1/jobs", raw(b"image=1", "text/plain"), 415, "Content-Type"),
    ("POST", "/v1/jobs", multipart({"prompt": "hi"}, with_image=False), 400, "attach the image as a file"),
    ("POST", "/v1/jobs", multipart({"image": "not a file"}, with_image=False), 400, "attach the image as a file"),
    ("POST", "/v1/jobs", multipart({"params": "{max_new_tokens: 3}"}), 400, "params: not valid JSON"),
    ("POST", "/v1/jobs", multipart({"params": json.dumps({"max_new_tokens": -1})}), 400, "params.max_new_tokens"),
    ("POST", "/v1/jobs", multipart({"colour": "red"}), 400, "colour"),
    ("POST", "/v1/jobs", {"data": {"prompt": "hi"}}, 415, "multipart/form-data"),
    ("POST", "/v1/jobs", multipart({"priority": "asap"}), 400, "priority"),
    (
        "POST",
        "/v1/jobs",
        raw(b"--xyz\r\nbroken", "multipart/form-data"),
        400,
        "multipart",
    ),
    ("POST", "/v1/jobs/batch", {"json": {"image": GOOD_IMAGE}}, 400, "list of jobs"),
    ("POST", "/v1/jobs/batch", {"json": []}, 400, "batch is empty"),
    (
        "POST",
        "/v1/jobs/batch",
        raw(b"", "application/jsonl"),
        400,
        "batch is empty",
    ),
    (
        "POST",
        "/v1/jobs/batch",
        raw(b"[1,"),
        400,
        "not valid JSON",
    ),
    ("POST", "/v1/jobs/batch", raw(b"a,b", "text/csv"), 415, "Content-Type"),
    ("GET", "/v1/jobs/wc-unknown", {}, 404, "no job wc-unknown"),
    ("GET", "/v1/jobs/bad id!", {}, 400, "job_id"),
    ("GET", "/v1/jobs/wc-unknown", {"params": {"wait": -1}}, 400, "wait"),
    ("GET", "/v1/jobs/wc-unknown", {"params": {"wait": 10_000}}, 400, "wait"),
    ("GET", "/v1/jobs/wc-unknown", {"params": {"wait": "soon"}}, 400, "wait"),
    ("DELETE", "/v1/jobs/wc-unknown", {}, 404, "no job wc-unknown"),
    ("DELETE", "/v1/jobs/a.b", {}, 400, "job_id"),
    ("POST", "/v1/chat/completions", {"json": chat(stream=True)}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"json": chat(n=17)}, 400, "n: 17 samples in one request; at most 16 (max_n)"),
    (
        "POST",
        "/v1/chat/completions",
        {"json": chat([image_part("data:image/png;base64," + GOOD_IMAGE)] * 9)},
        400,
        "max_images_per_request",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": MODEL, "messages": [{"role": "assistant", "content": [image_part("data:,")]}]}},
        400,
        "messages.0.content.0: image parts go in user messages",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": MODEL, "messages": [{"role": "system", "content": "be brief"}]}},
        400,
        "the last turn must be the user's",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"json": {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}},
        400,
        "messages.0.role",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"json": chat([image_part("ftp://example.com/cat.png")])},
        400,
        "messages.0.content.0.image_url.url: ftp://example.com/cat.png: URL scheme 'ftp' is not fetched",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"json": chat([image_part("https://u:pw@:80/x.png?sig=1")])},
        400,
        "image_url.url: https://u:***@:80/x.png?sig=***: the URL names no host",
    ),
    ("POST", "/v1/jobs", {"json": {"image_url": "s3://bucket-only"}}, 400, "image_url: s3://bucket-only: an s3://"),
    ("POST", "/v1/jobs", {"json": {"image_url": "gopher://h/x"}}, 400, "image_url: gopher://h/x: URL scheme"),
    ("POST", "/v1/jobs", {"json": {"image_url": "http://h:99999/x"}}, 400, "image_url: http://h:99999/x: not a valid"),
    ("POST", "/v1/jobs", {"json": job(image_url="https://h/x.png")}, 400, "at most one of image"),
    ("POST", "/v1/jobs", {"json": {"image_url": 7}}, 400, "image_url"),
    ("POST", "/v1/chat/completions", {"json": chat([image_part("file:///etc/passwd")])}, 400, "outside the allowed"),
    ("POST", "/v1/chat/completions", {"json": chat([image_part("data:image/png;base64,@@@")])}, 400, "base64"),
    ("POST", "/v1/chat/completions", {"json": chat([{"type": "audio", "audio": "x"}])}, 400, "messages.0.content"),
    ("POST", "/v1/chat/completions", {"json": {"messages": chat()["messages"]}}, 400, "model: Field required"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": []}}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"json": {**chat(), "model": "gpt-4o"}}, 404, "not served"),
    ("POST", "/v1/chat/completions", {"json": chat(max_tokens=0)}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"json": chat(temperature=-0.5)}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"json": chat(top_p=0)}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"json": chat(tools=[{"type": "function"}])}, 400, "tools"),
    ("POST", "/v1/chat/completions", {"json": chat(logprobs=True, top_logprobs=21)}, 400, "top_logprobs: 21"),
    ("POST", "/v1/chat/completions", {"json": chat(top_logprobs=2)}, 400, "top_logprobs needs logprobs"),
    ("POST", "/v1/chat/completions", {"json": chat(presence_penalty=2.5)}, 400, "presence_penalty"),
    ("POST", "/v1/chat/completions", {"json": chat(repetition_penalty=0)}, 400, "repetition_penalty"),
    (
        "POST",
        "/v1/chat/completions",
        {"json": {**chat(), "messages": [{"role": "tool", "content": "x"}]}},
        400,
        "messages.0.role",
    ),
    (
        "POST",
        "/v1/chat/completions",
        raw(b"{"),
        400,
        "not valid JSON",
    ),
    ("POST", "/v1/chat/completions", raw(b""), 400, "body"),
    ("GET", "/v1/nothing-here", {}, 404, "no route GET /v1/nothing-here"),
    ("PUT", "/v1/jobs", {"json": job()}, 405, "not allowed on"),
    ("GET", "/v1/chat/completions", {}, 405, "not allowed on"),
]


def test_a_hundred_malformed_requests_each_get_a_4xx_that_names_the_problem(gateway):
    cases = (CASES * 2)[: max(100, len(CASES))]  # every kind, then the first ones again on the same server
    assert len(CASES) >= 80 and len(cases) >= 100
    for method, path, kwargs, status, words in cases:
        reply = gateway.request(method, path, **kwargs)
        where = f"{method} {path} {str(kwargs)[-160:]}"
        assert reply.status_code == status, f"{where}: {reply.status_code} {reply.text[:300]}"
        error = reply.json()["error"]
        assert words in error["message"], f"{where}: {error['message']!r} does not mention {words!r}"
        assert error["code"] == status and error["type"]
    assert gateway.get("/health/live").status_code == 200
    good = gateway.post("/v1/jobs", json=job(prompt="still serving"))
    assert good.status_code == 202, good.text


def test_openapi_documents_the_error_shape_and_bodies(gateway):
    spec = gateway.get("/openapi.json").json()
    assert "multipart/form-data" in spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert "application/jsonl" in spec["paths"]["/v1/jobs/batch"]["post"]["requestBody"]["content"]
    operations = [op for path in spec["paths"].values() for op in path.values()]
    assert all("422" not in op["responses"] and "4XX" in op["responses"] for op in operations)
    assert {"JobRequest", "OpenAIBatchLine", "ErrorBody"} <= set(spec["components"]["schemas"])
