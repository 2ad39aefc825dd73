"""The live workers as the gateway sees them: a worker is live while its RQ worker key lives
(it expires `liveness_ttl_s` after the worker's last heartbeat); its model is in the stats it
publishes for `wicore status`."""

from __future__ import annotations

from redis import Redis

from wicore.worker.status import worker_rows


def live_models(connection: Redis) -> dict[str, int]:
    """model -> number of live workers serving it."""
    models: dict[str, int] = {}
    for row in worker_rows(connection):
        model = row["stats"].get("model")
        if isinstance(model, str):
            models[model] = models.get(model, 0) + 1
    return models
