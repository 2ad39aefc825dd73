"""`wicore serve` under crowds, a Redis that refuses writes, slow and hostile clients: a real
uvicorn on a loopback port, a real redis-server (the embedded 6.2), `null`-engine workers, httpx,
openai and raw sockets as clients. Maxmemory pulses on Redis 7 under workers and a submitting
gateway are in test_faults_maxmemory.py (the fault rig's `GatewayFeeder`).

- More waiting requests (long-polls, chat completions) than redis-py's pool has connections: each
  gets its answer; a long-poll whose client leaves ends at once.
- Redis out of memory, a read-only replica, failing snapshots: 503 with Retry-After in OpenAI's
  shape, /health/ready 503 meanwhile; no 500, no traceback.
- Clients whose headers never finish, or whose body stalls, past the descriptor limit: closed at
  their deadline; the gateway keeps answering and logs no tracebacks.
- Deep JSON, a FIFO or a symlink loop under the allowed root, an empty upload, an oversized
  chunked body, a client that leaves mid-upload: each a 4xx (or nothing at all), never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, closing
from pathlib import Path

import httpx
import pytest
from redis import Redis

from tests.helpers import (
    metric_total,
    png_bytes,
    scrape_metrics,
    start_gateway,
    start_worker,
    stop,
    wait_http,
    wait_until,
)
from wicore.embedded import EmbeddedRedis, free_port

openai = pytest.importorskip("openai")  # the test extra; absent on a bare GPU image

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

MODEL = "crowd"
POOL = 100  # redis-py's default connection pool size
IMAGE = base64.b64encode(png_bytes(7)).decode()


def tracebacks(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if "Traceback" in line or "Exception in ASGI" in line]


def gateway(redis_url: str, folder: Path, *args: str, env: dict | None = None, limit_fds: int | None = None):
    """(process, base URL, log path) of a `wicore serve` on a free port."""
    port, log = free_port(), folder / f"gateway-{time.monotonic_ns()}.log"
    command = ["serve", "--redis-url", redis_url, "--port", str(port), "--model-id", MODEL, *args]
    if limit_fds is None:
        process = start_gateway(*command[1:], env=env, log=log)
    else:  # the gateway under a descriptor limit, soft and hard
        with open(log, "wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "wicore.cli.main", *command],
                env={**os.environ, **(env or {})},
                stdout=sink,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit_fds, limit_fds)),
            )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/live", 60, process)
    return process, url, log


def chat_body(index: int) -> dict:
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}},
        {"type": "text", "text": f"waiter {index}"},
    ]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}]}


# -- crowds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("acl", ["default user", "user without CLIENT"])
def test_waiters_past_the_connection_pool_each_get_their_answer(tmp_path, acl):
    """Without CLIENT (an ACL that denies it), the gateway's result reader reads in short slices."""
    count = POOL + 60
    with EmbeddedRedis() as server, ExitStack() as stack:
        worker = start_worker("--redis-url", server.url, "--engine", "null", "--model-id", MODEL,
                              "--max-queue-delay-ms", "0", log=tmp_path / "worker.log")  # fmt: skip
        stack.callback(stop, worker, signal.SIGKILL)
        gateway_url = server.url
        if acl != "default user":
            Redis.from_url(server.url).acl_setuser("waiter", enabled=True, passwords=["+pw"], keys=["*"],
                                                   channels=["*"], commands=["+@all", "-client"])  # fmt: skip
            gateway_url = server.url.replace("redis://", "redis://waiter:pw@")
        process, url, log = gateway(gateway_url, tmp_path)
        stack.callback(stop, process)
        wait_until(lambda: httpx.get(url + "/health/ready").status_code == 200, 60, 0.2, "a ready gateway")
        polls, chats, left = asyncio.run(crowd(url, count, worker))
        samples = scrape_metrics(url + "/metrics")
    assert polls == {"finished": count}, polls
    assert chats == {200: count}, chats
    assert left < 5.0, f"a long-poll went on {left:.1f}s after its client left"
    answers = [dict(labels) for (name, labels), _ in samples.items() if name == "wicore:http_requests_total"]
    assert [a for a in answers if a["status"] == "503" and a["handler"] != "/health/ready"] == []
    assert not tracebacks(log)


async def crowd(url: str, count: int, worker: subprocess.Popen) -> tuple[dict, dict, float]:
    """`count` long-polls on jobs queued while the worker is frozen, then `count` chat completions
    through the openai client, then a long-poll whose client hangs up: (final statuses of the
    polls, HTTP statuses of the chats, seconds the abandoned poll lasted after its client left)."""
    limits = httpx.Limits(max_connections=count + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            jobs = [{"image": IMAGE, "prompt": f"poll {i}"} for i in range(count)]
            ids = [line["job_id"] for line in (await http.post("/v1/jobs/batch", json=jobs)).json()["jobs"]]
            polls = asyncio.gather(*(http.get(f"/v1/jobs/{i}", params={"wait": 60}) for i in ids))
            await asyncio.sleep(2)  # every poll waits, each past the pool's size
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        statuses = tally(
            reply.json()["status"] if reply.status_code == 200 else reply.status_code for reply in await polls
        )
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                    http_client=httpx.AsyncClient(limits=limits, timeout=120))  # fmt: skip
        chats = await asyncio.gather(*(chat(client, i) for i in range(count)), return_exceptions=True)
        left = await abandoned_poll(http, url, worker)
    return statuses, tally(chats), left


async def chat(client: openai.AsyncOpenAI, index: int) -> int:
    try:
        await client.chat.completions.create(**chat_body(index))
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code


def tally(values) -> dict:
    counts: dict = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


async def abandoned_poll(http: httpx.AsyncClient, url: str, worker: subprocess.Popen) -> float:
    """Seconds between a long-poll's client leaving and the gateway ending the request (499)."""
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        job_id = (await http.post("/v1/jobs", json={"image": IMAGE, "prompt": "abandoned"})).json()["job_id"]
        poll = asyncio.ensure_future(http.get(f"/v1/jobs/{job_id}", params={"wait": 60}))
        await asyncio.sleep(1)
        poll.cancel()  # httpx closes the connection under a cancelled request
        left_at = time.monotonic()
        while metric_total(scrape_metrics(url + "/metrics"), "wicore:http_requests_total", status="499") < 1:
            if time.monotonic() - left_at > 30:
                break
            await asyncio.sleep(0.1)
        return time.monotonic() - left_at
    finally:
        os.kill(worker.pid, signal.SIGCONT)


# -- Redis refusing writes ------------------------------------------------------------------------


def refuse_by_memory(connection: Redis, folder: Path) -> None:
    connection.config_set("maxmemory-policy", "noeviction")
    connection.config_set("maxmemory", 1)


def refuse_as_replica(connection: Redis, folder: Path) -> None:
    connection.replicaof("127.0.0.1", free_port())  # a primary that is not there: the data stays, read-only


def refuse_by_failed_snapshot(connection: Redis, folder: Path) -> None:
    """A background save that fails (its folder is gone) while a save point is set: MISCONF."""
    gone = folder / "gone"
    gone.mkdir()
    connection.config_set("dir", str(gone))
    connection.config_set("save", "3600 1")
    gone.rmdir()
    connection.bgsave()
    wait_until(lambda: connection.info("persistence")["rdb_last_bgsave_status"] == "err", 10, what="a failed save")


REFUSALS = {"OOM": refuse_by_memory, "READONLY": refuse_as_replica, "MISCONF": refuse_by_failed_snapshot}


def take_writes_again(connection: Redis, folder: Path) -> None:
    connection.config_set("maxmemory", 0)
    connection.replicaof("NO", "ONE")
    connection.config_set("dir", str(folder))
    connection.config_set("save", "")
    connection.bgsave()
    wait_until(lambda: connection.info("persistence")["rdb_bgsave_in_progress"] == 0, 10, what="a good save")


def refused_answers(http: httpx.Client, job_id: str) -> dict[str, httpx.Response]:
    """One request of each kind that writes."""
    return {
        "POST /v1/jobs": http.post("/v1/jobs", json={"image": IMAGE, "prompt": "refused"}),
        "POST /v1/jobs/batch": http.post("/v1/jobs/batch", json=[{"image": IMAGE, "prompt": "refused too"}]),
        "POST /v1/chat/completions": http.post("/v1/chat/completions", json=chat_body(-1)),
        "DELETE /v1/jobs": http.delete(f"/v1/jobs/{job_id}"),
        "GET /health/ready": http.get("/health/ready"),
    }


@pytest.mark.parametrize("refusal", ["OOM", "READONLY", "MISCONF"])
def test_redis_refusing_writes_is_a_503_with_retry_after(tmp_path, refusal):
    with EmbeddedRedis(tmp_path / "redis") as server, ExitStack() as stack:
        connection = Redis.from_url(server.url)
        process, url, log = gateway(server.url, tmp_path)
        stack.callback(stop, process)
        with httpx.Client(base_url=url, timeout=30) as http:
            job_id = http.post("/v1/jobs", json={"image": IMAGE, "prompt": "kept"}).json()["job_id"]
            REFUSALS[refusal](connection, tmp_path)
            answers = refused_answers(http, job_id)
            take_writes_again(connection, tmp_path / "redis")
            after = http.post("/v1/jobs", json={"image": IMAGE, "prompt": "after"})
            ready = http.get("/health/ready").json()
    for what, reply in answers.items():
        assert reply.status_code == 503 and reply.headers.get("retry-after"), (what, reply.status_code, reply.text)
        if what != "GET /health/ready":
            error = reply.json()["error"]
            assert error["code"] == 503 and refusal in error["message"] and error["type"] == "server_error", error
    assert "refuses writes" in answers["GET /health/ready"].json()["reason"]
    assert after.status_code == 202, after.text
    assert "no live worker" in ready["reason"], "with writes back, readiness waits only for a worker"
    assert not tracebacks(log)


# -- slow clients ---------------------------------------------------------------------------------


def test_slow_clients_are_cut_off_and_the_gateway_keeps_answering(tmp_path):
    """600 connections whose headers never finish, against a gateway allowed 512 descriptors (its
    cap: 128 connections), then a body that stalls: the gateway answers 429 with Retry-After while
    full, 200 once the header deadline has closed them, and logs no traceback."""
    env = {"WICORE_HEADER_TIMEOUT_S": "2", "WICORE_BODY_TIMEOUT_S": "2"}
    with EmbeddedRedis() as server, ExitStack() as stack:
        process, url, log = gateway(server.url, tmp_path, env=env, limit_fds=512)
        stack.callback(stop, process)
        port = int(url.rsplit(":", 1)[1])
        slow = [partial_request(port) for _ in range(600)]
        busy = httpx.get(url + "/health/live", timeout=5)
        wait_until(lambda: httpx.get(url + "/health/live", timeout=5).status_code == 200, 10, 0.2, "a free slot")
        closed = sum(closed_by_server(s) for s in slow)
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"image\": ")  # fmt: skip
        started = time.monotonic()
        stalled_closed = closed_by_server(stalled, wait_s=10)
        stalled_s = time.monotonic() - started
        for s in slow:
            s.close()
        live = httpx.get(url + "/health/live", timeout=5)
    assert busy.status_code in (200, 429) and (busy.status_code == 200 or busy.headers["retry-after"]), busy.text
    assert closed == 600, f"{closed} of 600 slow connections closed by their header deadline"
    assert stalled_closed and stalled_s < 6, f"a stalled body held its connection {stalled_s:.1f}s"
    assert live.status_code == 200
    assert not tracebacks(log) and log.stat().st_size < 100_000, log.read_text()[-2000:]


def partial_request(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    return s


def closed_by_server(s: socket.socket, wait_s: float = 5) -> bool:
    """True once the server closed `s` (whatever it wrote first), within `wait_s`."""
    s.settimeout(wait_s)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- hostile requests -----------------------------------------------------------------------------


def nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def test_hostile_requests_are_4xx_and_leave_no_traceback(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "good.png").write_bytes(png_bytes(3))
    os.mkfifo(root / "fifo.png")
    (root / "loop.png").symlink_to(root / "loop.png")
    deep = nested(256)
    jsonl = b"\n".join(
        [
            httpx.Request("POST", "/", json={"url": "/v1/jobs", "body": {"image": IMAGE, "metadata": deep}}).content,
            httpx.Request("POST", "/", json={"url": "/v1/jobs", "body": {"image": IMAGE}}).content,
        ]
    )
    env = {"WICORE_MAX_REQUEST_BYTES": "200000"}
    with EmbeddedRedis() as server, ExitStack() as stack:
        process, url, log = gateway(server.url, tmp_path, "--allow-root", str(root), env=env)
        stack.callback(stop, process)
        with httpx.Client(base_url=url, timeout=10) as http:
            one = http.post("/v1/jobs", json={"image": IMAGE, "metadata": deep})
            batch = http.post("/v1/jobs/batch", json=[{"image": IMAGE, "metadata": deep}, {"image": IMAGE}])
            lines = http.post("/v1/jobs/batch", content=jsonl, headers={"content-type": "application/jsonl"})
            fifo = http.post("/v1/jobs", json={"image_path": str(root / "fifo.png")})
            loop = http.post("/v1/jobs", json={"image_path": str(root / "loop.png")})
            in_chat = http.post("/v1/chat/completions", json={**chat_body(0), "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"file://{root / 'fifo.png'}"}}]}]})  # fmt: skip
            empty = http.post("/v1/jobs", files={"image": ("x.png", io.BytesIO(b""), "image/png")})
            chunked = http.post(
                "/v1/chat/completions",
                content=(b"x" * 10_000 for _ in range(50)),
                headers={"content-type": "application/json"},
            )
            leave_mid_upload(int(url.rsplit(":", 1)[1]))
            live = http.get("/health/live")
        time.sleep(0.5)
    assert one.status_code == 400 and one.json()["error"]["param"] == "metadata", one.text
    jobs = batch.json()["jobs"]
    assert batch.status_code == 202 and "metadata" in jobs[0]["error"] and jobs[1]["job_id"], batch.text
    assert lines.status_code == 202 and "metadata" in lines.json()["jobs"][0]["error"], lines.text
    assert lines.json()["accepted"] == 1
    for reply, field in ((fifo, "image_path"), (loop, "image_path"), (empty, "image")):
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert in_chat.status_code == 400 and "regular file" in in_chat.text, in_chat.text
    assert chunked.status_code == 413, chunked.text
    assert live.status_code == 200
    assert not tracebacks(log), log.read_text()[-3000:]


def leave_mid_upload(port: int) -> None:
    """A client that sends half its declared body and hangs up."""
    with closing(socket.create_connection(("127.0.0.1", port))) as s:
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"{" * 5000)  # fmt: skip
        time.sleep(0.3)
    with closing(socket.create_connection(("127.0.0.1", port))) as s:
        boundary = b"b0undary"
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=" + boundary +
                  b"\r\nContent-Length: 100000\r\n\r\n--" + boundary +
                  b'\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n\r\n' + b"x" * 5000)  # fmt: skip
        time.sleep(0.3)
