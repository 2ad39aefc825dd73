"""Prometheus metrics of one worker process (`wicore worker --metrics-port`).

Names follow vLLM's with the `wicore:` prefix (`vllm:e2e_request_latency_seconds` ->
`wicore:e2e_request_latency_seconds`), so dashboards built for vLLM map over; what vLLM has no
name for (failures, cancellations, step time, images, the vision cache) is named in the same
style. Each worker serves its own registry on its own port; Prometheus adds the instance label.

Per-job metrics are recorded as jobs end; the engine's own counters (KV pages, cache tiers, GPU
memory) are read from the snapshot the worker publishes for `wicore status`, so a scrape never
touches the engine from the server's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wicore.engines.base import Completion
from wicore.schemas import Timings

PREFIX = "wicore:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Prefix-cache tiers as the engine names them -> the metric name's tier word (vLLM: gpu, cpu).
PREFIX_TIERS = {"gpu": "gpu", "host": "cpu", "disk": "disk"}
VISION_TIERS = ("vision_cache", "vision_cache_shared")


class WorkerMetrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model)
        self.registry.register(self.engine)
        self._counters()
        self._histograms()
        self.running = self._gauge("num_requests_running", "Sequences in the engine.")
        self.waiting = self._gauge("num_requests_waiting", "Jobs claimed and not yet in the engine (images loading).")

    def _counters(self) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

        self.success = counter("request_success", "Jobs that ended with a result.", "finished_reason")
        self.failure = counter(
            "request_failure",
            "Jobs that ended in an error (kind input: the job's own fault, never retried; "
            "transient: retried while it has retries left).",
            "kind",
        )
        self.canceled_jobs = counter("request_canceled", "Jobs canceled while this worker held them.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished jobs.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished jobs.")
        self.images = counter("images_processed", "Images handed to the engine.")

    def _histograms(self) -> None:
        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self.queue_time = histogram("request_queue_time_seconds", "Submitted -> taken by a worker.", LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time in the engine.", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Submitted -> result written.", LATENCY_BUCKETS)
        self.first_token = histogram(
            "time_to_first_token_seconds", "Submitted -> first token generated.", LATENCY_BUCKETS
        )
        self.step_time = histogram("engine_step_duration_seconds", "One engine step (worker's view).", STEP_BUCKETS)
        self.batch_size = histogram("batch_size", "Sequences in the engine at each step.", BATCH_BUCKETS)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry)

    # -- what the worker reports ----------------------------------------------------------------

    def stepped(self, batch: int, seconds: float) -> None:
        self.step_time.labels(self.model).observe(seconds)
        self.batch_size.labels(self.model).observe(batch)

    def in_hand(self, running: int, waiting: int) -> None:
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)

    def admitted(self, images: int) -> None:
        self.images.labels(self.model).inc(images)

    def succeeded(self, completion: Completion, timings: Timings) -> None:
        self.success.labels(self.model, completion.finish_reason or "length").inc()
        self.prompt_tokens.labels(self.model).inc(completion.prompt_tokens)
        self.generation_tokens.labels(self.model).inc(len(completion.token_ids))
        self.queue_time.labels(self.model).observe(timings.queued_s)
        self.inference_time.labels(self.model).observe(timings.engine_s)
        self.e2e.labels(self.model).observe(timings.total_s)
        if timings.first_token_s is not None:
            self.first_token.labels(self.model).observe(timings.first_token_s)

    def failed(self, kind: str, count: int = 1) -> None:
        self.failure.labels(self.model, kind).inc(count)

    def canceled(self, count: int) -> None:
        self.canceled_jobs.labels(self.model).inc(count)

    def engine_snapshot(self, stats: dict[str, Any]) -> None:
        """The engine's counters as the worker last published them (read at scrape time)."""
        self.engine.stats = stats

    def serve(self, port: int, host: str) -> None:
        """Serve /metrics (and the probes, probes.py) on `host:port` from a daemon thread."""
        from wicore.worker.probes import WorkerHealth, serve_probes

        serve_probes(WorkerHealth("", registry=self.registry), port, host)


class EngineStatsCollector(Collector):
    """The engine's counters from the latest published snapshot, at scrape time. Engines report
    different keys (the fast engine has KV pages and cache tiers, the reference engine neither):
    what a snapshot lacks is not exported."""

    def __init__(self, model: str):
        self.model = model
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats.get("kv_pages"):
            used = stats.get("kv_pages_used", 0) / stats["kv_pages"]
            yield self._gauge("gpu_cache_usage_perc", "KV-cache pages held by sequences (1 = all).", used)
        if "peak_gpu_bytes" in stats and stats["peak_gpu_bytes"] is not None:
            yield self._gauge("gpu_memory_peak_bytes", "Most GPU memory the engine has held.", stats["peak_gpu_bytes"])
        tiers = stats.get("cache") or {}
        for tier, word in PREFIX_TIERS.items():
            if isinstance(tiers.get(tier), dict):
                yield from self._hits(f"{word}_prefix_cache", f"Prefix-cache {tier} tier, in KV blocks", tiers[tier])
        for name in VISION_TIERS:
            if isinstance(stats.get(name), dict):
                yield from self._hits(name, f"Image-embedding cache ({name}), in images", stats[name])

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        gauge.add_metric([self.model], float(value))
        return gauge

    def _hits(self, name: str, doc: str, tier: dict[str, Any]) -> Iterator[CounterMetricFamily]:
        hits, misses = int(tier.get("hits", 0)), int(tier.get("misses", 0))
        for suffix, value in (("hits", hits), ("queries", hits + misses)):
            counter = CounterMetricFamily(f"{PREFIX}{name}_{suffix}", f"{doc}: {suffix}.", labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
