"""A worker's Prometheus endpoint: scraped over HTTP after a run, parsed with prometheus_client's
text parser, its counters equal what happened to the jobs."""

from __future__ import annotations

from tests.helpers import metric_total, png_bytes, scrape_metrics
from wicore.embedded import free_port
from wicore.engines import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import GenerationParams
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL = "tiny"


def test_worker_metrics_count_the_jobs_it_ran(redis_conn, tiny_model_dir):
    engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4, options=FastOptions(torch_threads=1)))
    producer = Producer(redis_conn, model=MODEL)
    params = GenerationParams(max_new_tokens=5, ignore_eos=True)
    same_image = [Submission(png_bytes(1), f"question {i}?", params=params) for i in range(3)]
    others = [Submission(png_bytes(2 + i), "Describe.", params=params) for i in range(3)]
    broken = [Submission(b"not an image", params=params)]
    ids = producer.submit_many(same_image + others + broken)
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0)
    worker = BatchingWorker(redis_conn, engine, WorkerConfig(MODEL, policy=policy, burst=True))
    port = free_port()
    worker.metrics.serve(port, "127.0.0.1")
    worker.run()
    results = {o.job_id: o for o in producer.wait(ids, timeout=10)}
    samples = scrape_metrics(f"http://127.0.0.1:{port}/metrics")
    stats = engine.stats()  # the engine is idle: what the worker's last snapshot holds
    engine.close()

    assert metric_total(samples, "wicore:request_success_total", model_name=MODEL) == 6
    assert metric_total(samples, "wicore:request_success_total", finished_reason="length") == 6
    assert (
        metric_total(samples, "wicore:request_failure_total", kind="input")
        == 1
        == sum(1 for o in results.values() if o.error)
    )
    assert metric_total(samples, "wicore:generation_tokens_total") == 30
    prompt_tokens = sum(o.result.prompt_tokens for o in results.values() if o.result)
    assert metric_total(samples, "wicore:prompt_tokens_total") == prompt_tokens
    assert metric_total(samples, "wicore:images_processed_total") == 6
    assert metric_total(samples, "wicore:e2e_request_latency_seconds_count") == 6
    assert metric_total(samples, "wicore:request_queue_time_seconds_count") == 6
    assert metric_total(samples, "wicore:time_to_first_token_seconds_count") == 6
    first_tokens = [o.result.timings.first_token_s for o in results.values() if o.result]
    totals = [o.result.timings.total_s for o in results.values() if o.result]
    assert all(0 < first <= total for first, total in zip(first_tokens, totals, strict=True))
    assert metric_total(samples, "wicore:time_to_first_token_seconds_sum") <= metric_total(
        samples, "wicore:e2e_request_latency_seconds_sum"
    )
    assert metric_total(samples, "wicore:engine_step_duration_seconds_count") >= 5, "a step per token at least"
    assert metric_total(samples, "wicore:num_requests_running") == 0
    # The engine's own counters, from the snapshot the worker published when it stopped.
    assert metric_total(samples, "wicore:gpu_cache_usage_perc") == stats["kv_pages_used"] / stats["kv_pages"]
    vision, gpu = stats["vision_cache"], stats["cache"]["gpu"]
    assert metric_total(samples, "wicore:vision_cache_hits_total") == vision["hits"]
    assert metric_total(samples, "wicore:vision_cache_queries_total") == vision["hits"] + vision["misses"] >= 4
    assert metric_total(samples, "wicore:gpu_prefix_cache_hits_total") == gpu["hits"]
    assert metric_total(samples, "wicore:gpu_prefix_cache_queries_total") == gpu["hits"] + gpu["misses"]
