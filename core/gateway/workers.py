"""The live workers as the gateway sees them: a worker is live while its RQ worker key lives
(it expires `liveness_ttl_s` after the worker's last heartbeat); its model is in the stats it
publishes for `wicore status`."""

from __future__ import annotations

from collections import Counter

from redis import Redis

from wicore.worker.status import worker_rows


def live_models(connections: list[Redis]) -> dict[str, int]:
    """model -> number of live workers serving it, on every shard."""
    rows = [row for connection in connections for row in worker_rows(connection)]
    return dict(Counter(row["model"] for row in rows if row["model"]))
