"""The routes operators call: liveness and readiness probes, Prometheus metrics, and the JSON
of `wicore status`."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis import Redis
from redis.exceptions import RedisError, ResponseError

from wicore import keys
from wicore.gateway.auth import require_key
from wicore.gateway.errors import RETRY_DOWN, RETRY_REFUSED, refusal_code, refused_message
from wicore.worker.status import collect_shards

router = APIRouter(tags=["service"])


@router.get("/health/live")
def live() -> dict[str, str]:
    """The process answers (restart it when this fails)."""
    return {"status": "ok"}


@router.get(
    "/health/ready",
    responses={503: {"description": "Redis down or refusing writes, or no live worker serves the model."}},
)
def ready(request: Request) -> JSONResponse:
    """Redis answers and takes writes, and at least one live worker serves the gateway's model."""
    gateway = request.app.state.gateway
    model = gateway.config.model
    try:
        for connection in gateway.connections:
            probe_write(connection)
        workers = gateway.live_models().get(model, 0)
    except ResponseError as exc:
        if not (code := refusal_code(exc)):
            raise
        reason = refused_message(code, exc)
        return JSONResponse({"status": "unavailable", "reason": reason}, 503, headers=RETRY_REFUSED)
    except RedisError as exc:
        reason = f"Redis does not answer ({exc})"
        return JSONResponse({"status": "unavailable", "reason": reason}, 503, headers=RETRY_DOWN)
    if not workers:
        return JSONResponse({"status": "unavailable", "reason": f"no live worker serves model {model}"}, 503)
    return JSONResponse({"status": "ok", "model": model, "workers": workers})


def probe_write(connection: Redis) -> None:
    """A write Redis forgets by itself: refused while Redis is out of memory, a replica, or
    failing its snapshots."""
    connection.set(keys.probe(uuid.uuid4().hex), b"1", px=10_000)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text format: HTTP requests, jobs submitted, queue depth per bucket, workers."""
    return Response(request.app.state.gateway.metrics.page(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/stats", dependencies=[Depends(require_key)])
def stats(request: Request) -> dict[str, Any]:
    """What `wicore status` shows: bucket queues with their registries, workers and their counters."""
    gateway = request.app.state.gateway
    return collect_shards(gateway.connections, [f"shard {i}" for i in range(len(gateway.connections))])
