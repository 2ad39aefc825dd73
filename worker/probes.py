"""The worker's HTTP port (`--metrics-port`): Prometheus' /metrics and the probes an orchestrator
reads. It opens before the model loads, so a probe tells loading from dead.

    GET /health/live   200 while the process serves HTTP (restart it when this fails)
    GET /health/ready  200 once the engine is loaded, its last step did not raise and Redis
                       answers a PING; else 503 with the reason (take no traffic, do not restart)
    GET /metrics       the worker's registry (empty until the engine is loaded)
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis import Redis
from redis.exceptions import RedisError

PING_TIMEOUT_S = 1.0  # a readiness probe answers within its own timeout (k8s: 1 s by default)


@dataclass
class WorkerHealth:
    """What the probes read. `worker`: the BatchingWorker, once its engine is loaded."""

    redis_url: str
    worker: Any = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _ping: Redis | None = None

    def loaded(self, worker) -> None:
        self.worker, self.registry = worker, worker.metrics.registry

    def readiness(self) -> tuple[bool, str]:
        if self.worker is None:
            return False, "the engine is loading"
        if not self.worker.gate.last_step_ok:
            return False, "the engine's last step raised (see the worker's log)"
        return self._redis_answers()

    def _redis_answers(self) -> tuple[bool, str]:
        if not self.redis_url:
            return False, "no Redis URL"
        if self._ping is None:
            self._ping = Redis.from_url(self.redis_url, socket_timeout=PING_TIMEOUT_S,
                                        socket_connect_timeout=PING_TIMEOUT_S)  # fmt: skip
        try:
            self._ping.ping()
        except RedisError as exc:
            return False, f"Redis does not answer ({type(exc).__name__})"
        return True, "ok"


def serve_probes(health: WorkerHealth, port: int, host: str) -> ThreadingHTTPServer:
    """Serve /metrics and the probes on `host:port` from a daemon thread."""
    server = ThreadingHTTPServer((host, port), _handler(health))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


def _handler(health: WorkerHealth) -> type[BaseHTTPRequestHandler]:
    class Probes(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, generate_latest(health.registry), CONTENT_TYPE_LATEST)
            elif path == "/health/live":
                self._json(200, {"status": "ok"})
            elif path == "/health/ready":
                ready, reason = health.readiness()
                self._json(200 if ready else 503, {"status": "ok" if ready else "unavailable", "reason": reason})
            else:
                self._json(404, {"status": "not found", "routes": ["/metrics", "/health/live", "/health/ready"]})

        def _json(self, status: int, body: dict) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
            return

    return Probes
