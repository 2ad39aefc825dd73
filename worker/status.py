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


def collect_status(connection: Redis) -> dict[str, Any]:
    return {"queues": queue_rows(connection), "workers": worker_rows(connection)}


def queue_rows(connection: Redis) -> list[dict[str, Any]]:
    rows = []
    for queue in sorted(Queue.all(connection=connection, serializer=JSONSerializer), key=lambda q: q.name):
        if not queue.name.startswith(keys.QUEUE_PREFIX + "."):
            continue
        rows.append(
            {
                "name": queue.name,
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
        raw = connection.get(keys.stats(worker.name))
        stats = json.loads(raw) if raw else {}
        rows.append(
            {
                "name": worker.name,
                "state": str(getattr(worker.get_state(), "value", worker.get_state())),
                "running": connection.scard(worker.executions_key),
                "ok": worker.successful_job_count,
                "failed": worker.failed_job_count,
                "stats": stats,
                "stats_line": stats_line(stats),
            }
        )
    return rows
