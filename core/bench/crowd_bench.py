"""`wicore bench crowd`: many requests waiting at once on one gateway. A `wicore serve` and a
`null`-engine `wicore worker` on one Redis; then

- chat: N concurrent `POST /v1/chat/completions`, each waiting for its job's answer;
- poll: N jobs queued while the worker is frozen (SIGSTOP), N concurrent `GET /v1/jobs/{id}?wait=`
  long-polls on them, then the worker continues (SIGCONT) and every poll should get its result.

Each request must get its answer or a 429 (the gateway's documented answer to a crowd past its
limits); a 503 while Redis is healthy is a failure. The gateway's resident memory and open file
descriptors are read from /proc before and after."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx

from wicore.bench.queue_bench import tiny_png
from wicore.embedded import free_port

MODEL_ID = "bench-crowd"
POLL_WAIT_S = 120


def start(verb: str, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as sink:
        return subprocess.Popen([sys.executable, "-m", "wicore.cli.main", verb, *args], stdout=sink, stderr=sink)


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {timeout}s")


def process_usage(pid: int) -> dict:
    """Resident memory (MiB) and open file descriptors of process `pid`, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss_kb / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def chat_body(index: int) -> dict:
    image = base64.b64encode(tiny_png()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": f"crowd request {index}"},
    ]
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}


async def gather_statuses(requests) -> Counter:
    replies = await asyncio.gather(*requests, return_exceptions=True)
    return Counter(r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in replies)


def client(url: str, count: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=POLL_WAIT_S + 60)


async def chat_crowd(url: str, count: int) -> Counter:
    async with client(url, count) as http:
        return await gather_statuses([http.post("/v1/chat/completions", json=chat_body(i)) for i in range(count)])


async def poll_crowd(url: str, count: int, worker: subprocess.Popen) -> Counter:
    image = base64.b64encode(tiny_png()).decode()
    jobs = [{"image": image, "prompt": f"crowd poll {i}", "params": {"max_new_tokens": 4}} for i in range(count)]
    async with client(url, count) as http:
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            accepted = (await http.post("/v1/jobs/batch", json=jobs)).json()["jobs"]
            polls = [http.get(f"/v1/jobs/{line['job_id']}", params={"wait": POLL_WAIT_S}) for line in accepted]
            waiting = asyncio.ensure_future(gather_statuses(polls))
            await asyncio.sleep(3)  # every poll is waiting on its job
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        return await waiting


def run_bench(redis_url: str, count: int, folder: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        worker = start("worker", "--redis-url", redis_url, "--engine", "null", "--model-id", MODEL_ID,
                       "--batch-size", "64", "--max-queue-delay-ms", "0", log=folder / "worker.log")  # fmt: skip
        stack.callback(stop, worker)
        gateway = start("serve", "--redis-url", redis_url, "--port", str(port), "--model-id", MODEL_ID,
                        log=folder / "gateway.log")  # fmt: skip
        stack.callback(stop, gateway)
        wait_ready(url, gateway)
        before = process_usage(gateway.pid)
        started = time.perf_counter()
        chat = asyncio.run(chat_crowd(url, count))
        chat_s = time.perf_counter() - started
        after_chat = process_usage(gateway.pid)
        started = time.perf_counter()
        poll = asyncio.run(poll_crowd(url, count, worker))
        poll_s = time.perf_counter() - started
        after = process_usage(gateway.pid)
    return {
        "command": f"wicore bench crowd --requests {count}",
        "cpus": os.cpu_count(),
        "requests": count,
        "chat_statuses": dict(chat),
        "chat_s": round(chat_s, 2),
        "poll_statuses": dict(poll),
        "poll_s": round(poll_s, 2),
        "gateway_before": before,
        "gateway_after_chat": after_chat,
        "gateway_after": after,
    }


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def failures(report: dict) -> list[str]:
    """What breaks the promise: a request answered other than 200 or 429."""
    bad = []
    for side in ("chat", "poll"):
        others = {k: v for k, v in report[f"{side}_statuses"].items() if k not in (200, 429)}
        if others:
            bad.append(f"{side}: {others}")
    return bad
