"""What `wicore status` shows: bucket queues with their RQ registries, workers with their
counters and the engine/cache stats they publish."""

from __future__ import annotations

import json
from typing import Any

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer
from rq.worker import Worker

from wicore import keys
from wicore.scheduler.buckets import BucketKey

IDENTITY = ("model", "engine", "device", "dtype")  # what each worker publishes beside its counters


def collect_status(connection: Redis) -> dict[str, Any]:
    workers = worker_rows(connection)
    return {"queues": queue_rows(connection, served_by(workers)), "workers": workers}


COUNTS = ("queued", "started", "finished", "failed")


def collect_shards(connections: list[Redis], names: list[str]) -> dict[str, Any]:
    """`collect_status` of each shard (named by `names`: URLs without passwords), and their sum:
    queues of the same name add up, workers are listed from every shard. With one shard the
    report is that shard's alone (no `shards` key)."""
    shards = [{"shard": i, "url": name, **collect_status(c)} for i, (c, name) in enumerate(zip(connections, names))]
    queues: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for row in shard["queues"]:
            total = queues.setdefault(row["name"], {**row, **dict.fromkeys(COUNTS, 0), "served": False})
            total["served"] = total["served"] or row["served"]
            for count in COUNTS:
                total[count] += row[count]
    workers = [worker for shard in shards for worker in shard["workers"]]
    report = {"queues": sorted(queues.values(), key=lambda q: q["name"]), "workers": workers}
    return {**report, "shards": shards} if len(shards) > 1 else report


def served_models(connection: Redis) -> set[str]:
    """The model ids that live workers serve."""
    return served_by(worker_rows(connection))


def served_by(workers: list[dict[str, Any]]) -> set[str]:
    return {w["model"] for w in workers if w["model"]}


def queue_rows(connection: Redis, served: set[str]) -> list[dict[str, Any]]:
    """`served`: False when no live worker serves the queue's model (its jobs wait)."""
    rows = []
    for queue in sorted(Queue.all(connection=connection, serializer=JSONSerializer), key=lambda q: q.name):
        bucket = BucketKey.parse(queue.name)
        if bucket is None:
            continue
        rows.append(
            {
                "name": queue.name,
                "model": bucket.model,
                "served": bucket.model in served,
                "queued": queue.count,
                "started": queue.started_job_registry.count,
                "finished": queue.finished_job_registry.count,
                "failed": queue.failed_job_registry.count,
            }
        )
    return rows


def stats_line(stats: dict[str, Any]) -> str:
    """Counters first, then each cache tier as hits/lookups."""
    plain = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
             if isinstance(v, int | float) and not isinstance(v, bool)]  # fmt: skip
    tiers = [f"{k}: {v['hits']}/{v['hits'] + v['misses']} hits" for k, v in sorted(stats.items())
             if isinstance(v, dict) and "hits" in v]  # fmt: skip
    tiers += [f"{k}.{t}: {v['hits']}/{v['hits'] + v['misses']} hits" for k, tiers_ in sorted(stats.items())
              if isinstance(tiers_, dict) for t, v in tiers_.items() if isinstance(v, dict) and "hits" in v]  # fmt: skip
    return ", ".join(tiers + plain)


def worker_rows(connection: Redis) -> list[dict[str, Any]]:
    rows = []
    for worker in sorted(Worker.all(connection=connection), key=lambda w: w.name):
        stats = published_stats(connection, worker.name)
        identity = {field: _text(stats.pop(field, None)) for field in IDENTITY}
        rows.append(
            {
                "name": worker.name,
                **identity,
                "state": str(getattr(worker.get_state(), "value", worker.get_state())),
                "running": connection.scard(worker.executions_key),
                "ok": worker.successful_job_count,
                "failed": worker.failed_job_count,
                "stats": stats,
                "stats_line": stats_line(stats),
            }
        )
    return rows


def publish_stats(connection: Redis, worker: str, stats: dict[str, Any], liveness_ttl_s: float) -> None:
    """The worker's counters for `wicore status`, kept a few liveness periods past its last word."""
    connection.set(keys.stats(worker), json.dumps(stats), ex=max(60, int(liveness_ttl_s * 4)))


def published_stats(connection: Redis, worker: str) -> dict[str, Any]:
    """The worker's published JSON object; anything else (nothing is trusted from Redis) is {}."""
    try:
        stats = json.loads(connection.get(keys.stats(worker)) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
