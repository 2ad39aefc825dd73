"""The gateway's Prometheus metrics: HTTP requests by route and status with their latency
(prometheus-fastapi-instrumentator's names under `wicore:`), jobs submitted, and, read from
Redis at scrape time, the jobs in each bucket queue by status and the live workers per model
(what rq-exporter gives RQ users), so one scrape of any gateway shows the whole queue."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wicore.gateway.workers import live_models
from wicore.scheduler.buckets import BucketKey
from wicore.worker.status import queue_rows

PREFIX = "wicore:"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_STATUSES = ("queued", "started", "finished", "failed")
UNMATCHED = "unmatched"  # requests no route answered share one label value (bounded cardinality)


class GatewayMetrics:
    def __init__(self, connections: list[Redis]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "http_requests", "HTTP requests answered.", ["handler", "method", "status"], registry=self.registry
        )
        self.latency = Histogram(
            PREFIX + "http_request_duration_seconds",
            "HTTP request latency.",
            ["handler", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.submitted = Counter(
            PREFIX + "jobs_submitted",
            "Job ids handed out (resubmissions included).",
            ["model_name"],
            registry=self.registry,
        )
        self.refused = Counter(
            PREFIX + "jobs_refused",
            "Jobs refused by admission control (their lane at its cap of queued jobs): answered 429.",
            ["model_name", "lane"],
            registry=self.registry,
        )
        self.registry.register(QueueCollector(connections))

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, str(status)).inc()
        self.latency.labels(handler, method).observe(seconds)

    def page(self) -> bytes:
        return generate_latest(self.registry)


class QueueCollector(Collector):
    """Queue depths summed over every shard (a queue of the same name on two shards is one series)."""

    def __init__(self, connections: list[Redis]):
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            PREFIX + "queue_jobs",
            "Jobs in each bucket queue and its RQ registries.",
            labels=["queue", "model_name", "lane", "status"],
        )
        models = live_models(self.connections)
        for row in summed_rows(self.connections, set(models)):
            bucket = BucketKey.parse(row["name"])
            lane = bucket.lane.value if bucket else ""
            for status in QUEUE_STATUSES:
                jobs.add_metric([row["name"], row["model"], lane, status], row[status])
        yield jobs
        workers = GaugeMetricFamily(PREFIX + "workers", "Live workers per model.", labels=["model_name"])
        for model, count in sorted(models.items()):
            workers.add_metric([model], count)
        yield workers


def summed_rows(connections: list[Redis], served: set[str]) -> list[dict]:
    totals: dict[str, dict] = {}
    for connection in connections:
        for row in queue_rows(connection, served):
            total = totals.setdefault(row["name"], {**row, **dict.fromkeys(QUEUE_STATUSES, 0)})
            for status in QUEUE_STATUSES:
                total[status] += row[status]
    return list(totals.values())


class HttpMetrics:
    """ASGI middleware: each HTTP request's route template, method, status and latency."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            handler = getattr(scope.get("route"), "path", UNMATCHED)
            self.metrics.observe(handler, scope["method"], status[0], time.perf_counter() - start)
