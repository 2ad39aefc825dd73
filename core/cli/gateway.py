"""`wicore serve` and `wicore cancel`: the HTTP gateway, and canceling jobs by id. Neither
imports torch: the gateway holds no model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from wicore.cli.common import ConfigOption, RedisOption, friendly_errors, settings_from
from wicore.cli.jobs import _redis
from wicore.errors import UnknownJob

EXIT_UNKNOWN = 1


@friendly_errors
def cancel(
    job_ids: list[str] = typer.Argument(..., help="Job ids to cancel."),
    redis_url: str = RedisOption,
    config: Path = ConfigOption,
) -> None:
    """Cancel jobs: a queued job never runs, a running one stops at the engine's next step.
    Prints one JSON line per id with the status it ends in; exit 1 if an id is unknown."""
    from wicore.producer import Producer

    settings = settings_from(config, redis_url=redis_url)
    producer = Producer(_redis(settings), model="any")
    code = 0
    for job_id in job_ids:
        try:
            typer.echo(json.dumps({"job_id": job_id, "status": producer.cancel(job_id)}))
        except UnknownJob as exc:
            typer.echo(json.dumps({"job_id": job_id, "status": None, "error": str(exc)}))
            code = EXIT_UNKNOWN
    raise typer.Exit(code)
