"""The worker's probes on its metrics port, as Kubernetes reads them: live from the start, ready only
once the engine is loaded (and not while it loads), not ready while Redis is down (a real
redis-server, killed), live throughout; /metrics on the same port."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.helpers import start_worker, stop, wait_http, wait_until
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_ready_after_the_engine_loads_and_not_while_redis_is_down(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis())
        # the reference engine on the bundled model: its load (torch, transformers) takes seconds
        worker = start_worker("--redis-url", server.url, "--engine", "reference", "--metrics-port", str(port),
                              log=tmp_path / "worker.log")  # fmt: skip
        stack.callback(stop, worker, signal.SIGKILL)
        wait_http(base + "/health/live", 120, worker)
        loading = httpx.get(base + "/health/ready")
        wait_until(lambda: httpx.get(base + "/health/ready").status_code == 200, 180, 0.2, "a ready worker")
        metrics = httpx.get(base + "/metrics")
        server.stop()  # a real outage: the redis-server process ends
        time.sleep(0.5)
        down = httpx.get(base + "/health/ready", timeout=10)
        live = httpx.get(base + "/health/live")
    assert loading.status_code == 503 and loading.json()["reason"] == "the engine is loading"
    assert "wicore:request_success" in metrics.text or "wicore:num_requests_running" in metrics.text
    assert down.status_code == 503 and down.json()["reason"].startswith("Redis does not answer")
    assert live.status_code == 200, "a Redis outage is no reason to restart the worker"
