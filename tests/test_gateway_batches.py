"""OpenAI's Batch API on `wicore serve`, end to end with the official `openai` client: a real
uvicorn on loopback, a real redis-server and a CPU worker on the bundled demo captioner (its
caption of an example image is the file's name). Good lines answered under their custom_id, bad
ones in the error file, cancel and expiry mid-way, a gateway and a worker killed mid-batch; the
files in a folder, in Redis or in an S3 bucket (moto's server mode on loopback), the bucket
missing at startup and the S3 endpoint gone mid-batch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.helpers import WICORE, start_gateway, start_worker, stop, wait_http, wait_until
from tests.test_gateway import IMAGES, MODEL, caption_of
from tests.url_servers import BUCKET, S3_ENV, moto_process, s3_server
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow

ENDED = ("completed", "failed", "expired", "cancelled")


def good_line(i: int, image: Path, max_tokens: int = 32) -> dict:
    """Line i on `image`: its own seed makes it its own job (greedy decoding ignores it)."""
    content = [
        {"type": "image_url", "image_url": {"url": str(image)}},
        {"type": "text", "text": "Describe this image in detail."},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "seed": i}
    return {"custom_id": f"good-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def good_lines(count: int, max_tokens: int = 32) -> list[dict]:
    images = sorted(IMAGES.iterdir())
    return [good_line(i, images[i % len(images)], max_tokens) for i in range(count)]


def bad_lines() -> dict[str, str]:
    """custom_id -> raw line, one per kind of mistake (the malformed one has no custom_id)."""
    image = sorted(IMAGES.iterdir())[0]
    missing = good_line(0, IMAGES / "no-such-image.png")
    unknown = good_line(1, image)
    unknown["body"]["model"] = "no-such-model"
    lines = {
        "bad-url": {**good_line(2, image), "url": "/v1/embeddings"},
        "bad-endpoint": {**good_line(3, image), "url": "/v1/jobs"},
        "bad-image": missing,
        "bad-model": unknown,
        "bad-body": {**good_line(4, image), "body": {"model": MODEL}},
        "bad-outside": good_line(5, Path("/etc/hostname")),
    }
    raw = {cid: json.dumps({**line, "custom_id": cid}) for cid, line in lines.items()}
    return {**raw, "": '{"custom_id": "broken", "method": "POST", '}


def jsonl(lines: list[dict], extra: list[str] = ()) -> bytes:
    return ("\n".join([json.dumps(line) for line in lines] + list(extra)) + "\n").encode()


def expected_caption(custom_id: str) -> str:
    images = sorted(IMAGES.iterdir())
    return caption_of(images[int(custom_id.split("-")[1]) % len(images)])


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


def worker_process(redis_url: str, log: Path):
    metrics_port = free_port()
    process = start_worker(
        "--redis-url", redis_url, "--engine", "fast", "--engine-option", "torch_threads=1",
        "--batch-size", "16", "--metrics-port", str(metrics_port), "--allow-root", str(IMAGES),
        log=log,
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{metrics_port}/metrics", 120, process)
    return process


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    process = worker_process(redis_server.url, tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    stop(process, signal.SIGKILL)


def gateway_process(redis_url: str, folder: Path, env: dict | None = None, log: str = "gateway.log"):
    port = free_port()
    env = {"WICORE_FILES_DIR": str(folder / "files"), **(env or {})}
    process = start_gateway(
        "--redis-url", redis_url, "--port", str(port), "--allow-root", str(IMAGES), env=env, log=folder / log
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/live", 60, process)
    return process, url


@pytest.fixture(scope="module")
def gateway(redis_server, worker, tmp_path_factory):
    process, url = gateway_process(redis_server.url, tmp_path_factory.mktemp("gateway"))
    yield url
    stop(process)


def s3_store_env(endpoint: str, url: str = f"s3://{BUCKET}/batch-files") -> dict:
    return {**S3_ENV, "WICORE_FILES_STORE": "s3", "WICORE_FILES_S3_URL": url, "WICORE_S3_ENDPOINT_URL": endpoint}


@pytest.fixture(scope="module")
def s3_gateway(redis_server, worker, tmp_path_factory):
    """A gateway whose files live in an S3 bucket, beside the folder one on the same Redis."""
    with s3_server() as endpoint:
        process, url = gateway_process(redis_server.url, tmp_path_factory.mktemp("s3"), env=s3_store_env(endpoint))
        yield url
        stop(process)


def client_of(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def submit(client, data: bytes, **fields):
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", **fields
    )


def wait_ended(client, batch_id: str, timeout: float = 300, seen: set | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if seen is not None:
            seen.add(batch.status)
        if batch.status in ENDED:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def check_answers(output: list[dict]) -> None:
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"] == expected_caption(line["custom_id"]), line
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]


def no_line_twice(*files: list[dict]) -> list[str]:
    ids = [line["custom_id"] for lines in files for line in lines if line["custom_id"] is not None]
    assert not [cid for cid, n in Counter(ids).items() if n > 1], "a custom_id written twice"
    return ids


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_every_good_line_answered_and_every_bad_line_in_the_error_file(request, redis_server, store):
    from redis import Redis

    client = client_of(request.getfixturevalue("gateway" if store == "folder" else "s3_gateway"))
    bad = bad_lines()
    good = good_lines(300)
    for line in good:
        line["body"]["seed"] += 50_000 if store == "s3" else 0  # jobs of their own, not the folder run's
    mixed = [json.dumps(line) for line in good[:150]] + list(bad.values()) + [""]
    data = ("\n".join(mixed + [json.dumps(line) for line in good[150:]]) + "\n").encode()
    batch = submit(client, data, metadata={"run": "ci"})
    assert batch.status == "validating" and batch.metadata == {"run": "ci"} and batch.completion_window == "24h"
    seen: set = set()
    batch = wait_ended(client, batch.id, seen=seen)
    assert batch.status == "completed" and "in_progress" in seen, (batch, seen)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (307, 300, 7)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    check_answers(output)
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in good)
    by_id = {line["custom_id"] or "": line for line in errors}
    assert set(by_id) == set(bad), by_id.keys()
    for line in by_id.values():
        assert line["response"]["status_code"] == 400 and line["response"]["body"]["error"]["message"], line
    assert "model" in by_id["bad-model"]["response"]["body"]["error"]["message"]
    assert "no-such-image" in by_id["bad-image"]["response"]["body"]["error"]["message"]
    assert "url" in by_id["bad-url"]["response"]["body"]["error"]["message"]
    no_line_twice(output, errors)
    job = Redis.from_url(redis_server.url).hget(f"rq:job:{output[0]['response']['request_id']}", "origin")
    assert job is not None and b".low." in job, "batch lines run in the low lane, after interactive jobs"
    listed = {f.id: f for f in client.files.list()}
    assert listed[batch.output_file_id].purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]


def test_a_thousand_lines_and_twenty_one_bad_ones(gateway):
    """The issue's acceptance size: 1,000 good lines of the six examples, three of each bad kind."""
    client = client_of(gateway)
    good = good_lines(1000)
    for line in good:
        line["body"]["seed"] += 40_000
    bad = [
        raw.replace(f'"{cid}"', f'"{cid}-{copy}"') if cid else raw
        for copy in range(3)
        for cid, raw in bad_lines().items()
    ]
    batch = wait_ended(client, submit(client, jsonl(good[:500], bad) + jsonl(good[500:])).id, timeout=600)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (1021, 1000, 21)
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    check_answers(output)
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in good)
    assert len(errors) == 21 and all(line["response"]["status_code"] == 400 for line in errors)
    no_line_twice(output, errors)


def test_bad_requests_get_openai_errors_naming_the_field(gateway):
    import openai

    client = client_of(gateway)
    uploaded = client.files.create(file=("r.jsonl", jsonl(good_lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError, match="input_file_id"):
        client.batches.create(input_file_id="file-nothere", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("r.jsonl", b"{}"), purpose="fine-tune")
    blank = client.files.create(file=("blank.jsonl", b"\n \n"), purpose="batch")
    chat = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    failed = wait_ended(client, client.batches.create(input_file_id=blank.id, **chat).id)
    assert failed.status == "failed" and failed.failed_at and failed.errors.data[0].code == "empty_file"
    assert client.files.retrieve(uploaded.id).bytes == len(jsonl(good_lines(1)))
    assert client.files.content(uploaded.id).content == jsonl(good_lines(1))
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_cancel_mid_way_keeps_the_done_lines(gateway):
    client = client_of(gateway)
    good = good_lines(400, max_tokens=200)
    for line in good:
        line["body"]["ignore_eos"] = True
    batch = submit(client, jsonl(good))
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, 120, 0.1, "done lines")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    counts = batch.request_counts
    assert counts.completed >= 10 and counts.failed > 0 and counts.completed + counts.failed == counts.total == 400
    output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    for line in output:
        assert line["response"]["body"]["usage"]["completion_tokens"] == 200
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert sorted(no_line_twice(output, errors)) == sorted(line["custom_id"] for line in good)


def test_a_batch_past_its_window_ends_expired_with_its_done_lines(redis_server, worker, tmp_path):
    """A gateway whose "24h" lasts 6 s, its files in Redis."""
    process, url = gateway_process(
        redis_server.url, tmp_path, env={"WICORE_BATCH_WINDOW_S": "6", "WICORE_FILES_STORE": "redis"}
    )
    try:
        client = client_of(url)
        good = good_lines(400, max_tokens=200)
        for line in good:
            line["body"]["ignore_eos"] = True
            line["body"]["seed"] += 10_000
        batch = wait_ended(client, submit(client, jsonl(good)).id, timeout=120)
        output, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    finally:
        stop(process)
    assert batch.status == "expired" and batch.expired_at
    counts = batch.request_counts
    assert counts.completed > 0 and counts.failed > 0 and counts.completed + counts.failed == counts.total == 400
    assert len(output) == counts.completed and {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert sorted(no_line_twice(output, errors)) == sorted(line["custom_id"] for line in good)


@pytest.mark.faults
@pytest.mark.parametrize(
    "stop_gateway, store",
    [(signal.SIGTERM, "folder"), (signal.SIGKILL, "folder"), (signal.SIGKILL, "s3")],
    ids=["restarted", "killed", "killed-s3"],
)
def test_gateway_and_worker_killed_mid_batch_lose_nothing(redis_server, tmp_path, stop_gateway, store):
    """Stop the gateway (SIGTERM: it hands its lease back; kill -9: the lease runs out) and
    kill -9 the worker while the batch runs; a new gateway takes the batch over, a new worker
    reruns the jobs the dead one held."""
    with s3_server() if store == "s3" else contextlib.nullcontext() as endpoint:
        env = s3_store_env(endpoint) if endpoint else None
        batch, good, output = kill_mid_batch(redis_server.url, tmp_path, stop_gateway, env)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (300, 0)
    check_answers(output)
    assert sorted(no_line_twice(output)) == sorted(line["custom_id"] for line in good)
    assert batch.error_file_id is None


def kill_mid_batch(redis_url: str, tmp_path: Path, stop_gateway: int, env: dict | None):
    """(the batch at its end, its lines, its output lines)"""
    worker = worker_process(redis_url, tmp_path / "worker1.log")
    try:
        process, url = gateway_process(redis_url, tmp_path, env=env, log="gateway1.log")
    except BaseException:
        stop(worker, signal.SIGKILL)
        raise
    try:
        client = client_of(url)
        good = good_lines(300, max_tokens=48)
        for line in good:
            line["body"]["seed"] += 20_000 + 1000 * stop_gateway + (500 if env else 0)
        batch = submit(client, jsonl(good))
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, 120, 0.05, "done lines")
        process.send_signal(stop_gateway)
        worker.send_signal(signal.SIGKILL)
        process.wait(), worker.wait()
        worker = worker_process(redis_url, tmp_path / "worker2.log")
        process, url = gateway_process(redis_url, tmp_path, env=env, log="gateway2.log")
        client = client_of(url)
        batch = wait_ended(client, batch.id, timeout=300)
        return batch, good, lines_of(client, batch.output_file_id)
    finally:
        stop(process)
        stop(worker, signal.SIGKILL)


def test_a_missing_bucket_stops_the_gateway_with_one_line_and_exit_2(redis_server, tmp_path):
    with s3_server() as endpoint:
        env = s3_store_env(endpoint, "s3://no-such-bucket/files")
        ended = subprocess.run(
            [WICORE, "serve", "--redis-url", redis_server.url, "--port", str(free_port())],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    said = (ended.stdout + ended.stderr).strip()
    assert ended.returncode == 2 and len(said.splitlines()) == 1, said
    assert "no bucket 'no-such-bucket'" in said and "testing" not in said


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_an_upload_over_the_store_limit_is_a_413_and_leaves_nothing_behind(redis_server, tmp_path, store):
    """Over max_file_bytes after one piece was already stored: that piece goes too."""
    import openai
    import s3fs

    limit = 3 * 2**19  # 1.5 MiB: the first 1 MiB piece is stored, the second goes over
    with s3_server() as endpoint:
        env = s3_store_env(endpoint, f"s3://{BUCKET}/capped") if store == "s3" else {}
        env["WICORE_MAX_FILE_BYTES"] = str(limit)
        process, url = gateway_process(redis_server.url, tmp_path, env=env)
        try:
            client = client_of(url)
            with pytest.raises(openai.APIStatusError, match="max_file_bytes") as refused:
                client.files.create(file=("big.jsonl", b"x" * (2 * limit)), purpose="batch")
            assert refused.value.status_code == 413 and refused.value.body["param"] == "file"
            kept = client.files.create(file=("ok.jsonl", b"y" * limit), purpose="batch")
            assert client.files.content(kept.id).content == b"y" * limit
        finally:
            stop(process)
        if store == "s3":
            fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)
            left = fs.find(f"{BUCKET}/capped/")
        else:
            left = [str(path) for path in (tmp_path / "files").iterdir()]
    assert len(left) == (2 if store == "s3" else 1) and all(kept.id in path for path in left), left


@pytest.mark.faults
def test_s3_hung_mid_batch_the_batch_waits_and_the_other_routes_answer(redis_server, worker, tmp_path):
    """The S3 server stops answering while a batch runs (SIGSTOP): the batch stays in progress,
    the file routes answer 503 within the store's timeout, chat completions, batch status and
    health answer 200; after SIGCONT the batch ends with every line once."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = moto_process(port, tmp_path / "moto.log")
    try:
        env = {**s3_store_env(endpoint), "WICORE_FILES_S3_TIMEOUT_S": "1"}
        process, url = gateway_process(redis_server.url, tmp_path, env=env)
        try:
            client = client_of(url)
            good = good_lines(300, max_tokens=48)
            for line in good:
                line["body"]["seed"] += 60_000
            batch = submit(client, jsonl(good))
            wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, 120, 0.05, "done")
            s3.send_signal(signal.SIGSTOP)
            wait_until(lambda: b"file store" in (tmp_path / "gateway.log").read_bytes(), 60, 0.2, "the runner waiting")
            check_routes_while_the_store_hangs(client, url, batch, good)
            s3.send_signal(signal.SIGCONT)
            batch = wait_ended(client, batch.id, timeout=300)
            output = lines_of(client, batch.output_file_id)
        finally:
            stop(process)
    finally:
        s3.send_signal(signal.SIGCONT)
        stop(s3)
    assert batch.status == "completed" and batch.request_counts.completed == 300, batch
    check_answers(output)
    assert sorted(no_line_twice(output)) == sorted(line["custom_id"] for line in good)


def check_routes_while_the_store_hangs(client, url: str, batch, good: list[dict]) -> None:
    assert client.batches.retrieve(batch.id).status == "in_progress"
    content = httpx.get(f"{url}/v1/files/{batch.input_file_id}/content", timeout=60)
    assert content.status_code == 503 and "file store" in content.json()["error"]["message"], content.text
    assert content.headers["retry-after"] and "testing" not in content.text
    assert httpx.delete(f"{url}/v1/files/{batch.input_file_id}", timeout=60).status_code == 503
    assert client.files.retrieve(batch.input_file_id).id == batch.input_file_id  # still listed
    upload = httpx.post(
        f"{url}/v1/files", files={"file": ("r.jsonl", jsonl(good[:2]))}, data={"purpose": "batch"}, timeout=60
    )
    assert upload.status_code == 503, upload.text
    assert httpx.get(url + "/health/live").status_code == 200
    answer = client.chat.completions.create(model=MODEL, messages=good[0]["body"]["messages"], max_tokens=8)
    assert answer.choices[0].message.content


def test_existing_batch_route_stays(gateway):
    line = json.dumps(good_line(0, sorted(IMAGES.iterdir())[0]))
    reply = httpx.post(gateway + "/v1/jobs/batch", content=line, headers={"content-type": "application/jsonl"})
    assert reply.status_code == 202 and reply.json()["accepted"] == 1


def write_jsonl(path: Path, good: list[dict], extra: list[str] = ()) -> Path:
    path.write_bytes(jsonl(good, extra))
    return path


def test_the_batch_verbs_over_the_api(gateway, tmp_path):
    from tests.helpers import wicore

    api = ("--base-url", gateway + "/v1")
    good = good_lines(30)
    for line in good:
        line["body"]["seed"] += 30_000
    source = write_jsonl(tmp_path / "in.jsonl", good, list(bad_lines().values()))
    batch = json.loads(wicore("batch", "submit", str(source), "--metadata", "team=vision", *api).stdout)
    assert batch["status"] == "validating" and batch["metadata"] == {"team": "vision"}
    waited = wicore("batch", "wait", batch["id"], *api, check=False)
    assert waited.returncode == 0 and json.loads(waited.stdout)["status"] == "completed", waited
    status = json.loads(wicore("batch", "status", batch["id"], *api).stdout)
    assert status["request_counts"] == {"total": 37, "completed": 30, "failed": 7}
    wicore("batch", "download", batch["id"], "-o", str(tmp_path / "out.jsonl"), *api)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    check_answers([line for line in lines if line["error"] is None and line["response"]["status_code"] == 200])
    assert len(lines) == 37 and len(no_line_twice(lines)) == 36  # the malformed line has no custom_id
    late = wicore("batch", "cancel", batch["id"], *api, check=False)
    assert late.returncode == 2 and late.stderr.count("\n") == 1 and "completed" in late.stderr
    missing = wicore("batch", "status", "batch-nothere", *api, check=False)
    assert missing.returncode == 2 and "no batch" in missing.stderr
    down = wicore("batch", "status", batch["id"], "--base-url", f"http://127.0.0.1:{free_port()}/v1", check=False)
    assert down.returncode == 1 and down.stderr.count("\n") == 1


def test_run_batch_offline(tmp_path):
    from tests.helpers import wicore

    good = good_lines(12)
    source = write_jsonl(tmp_path / "in.jsonl", good, [bad_lines()["bad-model"]])
    run = wicore("run-batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--engine", "fast", check=False)
    assert run.returncode == 1 and "12 answered, 1 errors of 13 lines" in run.stderr, run
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    check_answers(lines[:12])
    assert lines[12]["custom_id"] == "bad-model" and lines[12]["response"]["status_code"] == 400
    again = wicore("run-batch", str(write_jsonl(tmp_path / "good.jsonl", good)), "-o", str(tmp_path / "o2.jsonl"))
    assert again.returncode == 0
