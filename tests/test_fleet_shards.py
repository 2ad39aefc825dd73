"""Every verb and the gateway over two real redis-servers given as one list (`--redis-url A,B`,
`WICORE_REDIS_URL=A,B`): jobs spread over both shards, every job found, canceled and waited for
through the list, `status` sums both and shows each, workers spread one shard each, the
dashboard lists both instances."""

from __future__ import annotations

import json
import signal
from contextlib import ExitStack

import httpx
import pytest

from tests.helpers import (
    png_bytes,
    queued_ids,
    start_cli,
    start_gateway,
    start_worker,
    stop,
    wait_http,
    wait_until,
    wicore,
    write_images,
)
from wicore.embedded import free_port
from wicore.producer import shard_of

pytestmark = pytest.mark.slow
MODEL = "fleet"
NULL = ["--engine", "null", "--model-id", MODEL, "--max-queue-delay-ms", "0"]


def live_workers(url: str) -> list[dict]:
    return json.loads(wicore("status", "--json", "--redis-url", url).stdout)["workers"]


def test_enqueue_cancel_status_worker_result_over_a_shard_list(tmp_path, shard_urls, shards):
    both = ",".join(shard_urls)
    paths = write_images(tmp_path / "imgs", 30)
    enqueued = wicore("enqueue", str(tmp_path / "imgs"), "--redis-url", both, "--model-id", MODEL)
    ids = [line.split("\t")[0] for line in enqueued.stdout.splitlines()]
    assert len(set(ids)) == len(paths) == 30
    held = [queued_ids(connection) for connection in shards]
    assert held[0] and held[1] and held[0] | held[1] == set(ids) and not held[0] & held[1]
    assert all(shard_of(job_id, 2) == k for k, on in enumerate(held) for job_id in on)

    status = json.loads(wicore("status", "--json", "--redis-url", both).stdout)
    assert [s["url"] for s in status["shards"]] == shard_urls
    assert sum(q["queued"] for q in status["queues"]) == 30
    assert [sum(q["queued"] for q in s["queues"]) for s in status["shards"]] == [len(held[0]), len(held[1])]
    table = wicore("status", "--redis-url", both).stdout
    assert f"shard 0: {shard_urls[0]}" in table and f"shard 1: {shard_urls[1]}" in table

    dropped = [sorted(held[0])[0], sorted(held[1])[0]]
    canceled = wicore("cancel", *dropped, env={"WICORE_REDIS_URL": both})
    assert [json.loads(line)["status"] for line in canceled.stdout.splitlines()] == ["canceled", "canceled"]

    with ExitStack() as stack:
        worker = start_worker("--workers", "2", "--redis-url", both, *NULL, log=tmp_path / "workers.log")
        stack.callback(stop, worker)
        for url in shard_urls:  # one worker on each shard
            wait_until(lambda url=url: len(live_workers(url)) == 1, 120, 0.5, f"a worker on {url}")
        results = wicore("result", "-", "--wait", "120", "--redis-url", both, stdin=enqueued.stdout, check=False)
    lines = [json.loads(line) for line in results.stdout.splitlines()]
    assert results.returncode == 1, "two jobs were canceled"
    by_status = {line["job_id"]: line["status"] for line in lines}
    assert len(lines) == 30 and {by_status[i] for i in dropped} == {"canceled"}
    assert {status for job_id, status in by_status.items() if job_id not in dropped} == {"finished"}


def test_gateway_over_a_shard_list(tmp_path, shard_urls, shards):
    both = ",".join(shard_urls)
    port = free_port()
    with ExitStack() as stack:
        for index in (0, 1):
            worker = start_worker(
                "--redis-url", both, "--redis-shard", str(index), *NULL, log=tmp_path / f"w{index}.log"
            )
            stack.callback(stop, worker, signal.SIGKILL)
        gateway = start_gateway("--redis-url", both, "--port", str(port), "--model-id", MODEL, log=tmp_path / "gw.log")
        stack.callback(stop, gateway)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health/live", 60, gateway)
        wait_until(lambda: httpx.get(url + "/health/ready").status_code == 200, 120, 0.2, "a ready gateway")
        with httpx.Client(base_url=url, timeout=60) as http:
            jobs = [{"image": png_bytes(i).hex(), "prompt": f"job {i}"} for i in range(12)]
            ids = [http.post("/v1/jobs", json=job_body(job)).json()["job_id"] for job in jobs]
            finished = [http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] for job_id in ids]
            chat = http.post("/v1/chat/completions", json=chat_body())
            stats = http.get("/v1/stats").json()
    assert {shard_of(job_id, 2) for job_id in ids} == {0, 1}
    assert finished == ["finished"] * 12
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"]
    assert [len(shard["workers"]) for shard in stats["shards"]] == [1, 1]


def test_the_dashboard_lists_each_shard_as_an_instance(tmp_path, shard_urls, shards):
    port = free_port()
    dashboard = start_cli("dashboard", "--redis-url", ",".join(shard_urls), "--port", str(port), log=tmp_path / "d.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/", 60, dashboard)
        pages = [httpx.get(f"http://127.0.0.1:{port}/{i}/view/queues", follow_redirects=True).text for i in (0, 1)]
    finally:
        stop(dashboard)
    for url in shard_urls:
        assert all(url in page for page in pages), "the instance list names both shards"


def job_body(job: dict) -> dict:
    import base64

    return {"image": base64.b64encode(bytes.fromhex(job["image"])).decode(), "prompt": job["prompt"]}


def chat_body() -> dict:
    import base64

    image = "data:image/png;base64," + base64.b64encode(png_bytes(99)).decode()
    parts = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": image}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}


def test_caption_over_a_shard_list(tmp_path, shard_urls, shards):
    both = ",".join(shard_urls)
    write_images(tmp_path / "imgs", 20)
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    one = wicore("caption", str(tmp_path / "imgs"), "-o", str(out), "--redis-url", both, env=env, check=False)
    assert one.returncode == 2 and "each shard needs one" in one.stderr
    wicore("caption", str(tmp_path / "imgs"), "-o", str(out), "--redis-url", both, "--workers", "2",
           "--engine", "null", env=env)  # fmt: skip
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 20 and {line["status"] for line in lines} == {"finished"}
    assert {shard_of(line["job_id"], 2) for line in lines} == {0, 1}
