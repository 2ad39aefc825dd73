"""`wicore serve` and `wicore cancel`: the HTTP gateway, and canceling jobs by id. Neither
imports torch: the gateway holds no model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from wicore.cli.common import (
    ConfigOption,
    ModelIdOption,
    ModelOption,
    RedisOption,
    RedisPasswordFileOption,
    console,
    friendly_errors,
    settings_from,
)
from wicore.cli.failures import DebugOption, ExitCode, debug_level
from wicore.cli.jobs import ID_FILE_HELP, read_job_ids
from wicore.cli.redis_check import connect_shards
from wicore.config import Settings
from wicore.errors import ConfigError
from wicore.models import model_dir_and_id


@friendly_errors
def serve(
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    host: str = typer.Option(None, help="Interface to listen on [127.0.0.1].", show_default=False),
    port: int = typer.Option(None, help="Port to listen on [8000].", show_default=False),
    api_key: list[str] = typer.Option(None, help="Accepted bearer key (repeatable; also WICORE_API_KEYS=k1,k2)."),
    allow_root: list[Path] = typer.Option(None, help="Folder image paths may point into (repeatable)."),
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """The HTTP gateway: native job routes, OpenAI-compatible chat completions, health probes and
    Prometheus metrics, over Redis (it holds no model; run workers beside it)."""
    settings = settings_from(
        config,
        redis_url=redis_url,
        redis_password_file=redis_password_file,
        model=model,
        model_id=model_id,
        host=host,
        port=port,
        api_keys=api_key or None,
        allowed_roots=allow_root or None,
        log_level=debug_level(debug),
    )
    for connection in connect_shards(settings.redis_urls):  # a bad URL or password fails here, before the server starts
        connection.close()
    from wicore.gateway.app import create_app
    from wicore.gateway.server import ServerLimits, run

    check_port_free(settings.host, settings.port)
    gateway = gateway_config(settings)
    app = create_app(gateway)  # the file store is checked here, before the banner
    keys = f"{len(gateway.api_keys)} API keys" if gateway.api_keys else "no API key (open)"
    where = f"http://{settings.host}:{settings.port}/"
    console.print(f"gateway on {where} (docs at /docs), model {gateway.model}, {keys}", markup=False)
    limits = ServerLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keep_alive_s=settings.keep_alive_s,
        max_connections=settings.max_connections,
    )
    run(app, settings.host, settings.port, limits, settings.log_level.lower())


def check_port_free(host: str, port: int) -> None:
    """A port another process listens on is a bad --port, said before the server starts (uvicorn
    would log it and exit with its own status)."""
    import socket

    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(f"cannot listen on {host}:{port} ({reason}): free the port or pass another --port") from exc


def gateway_config(settings: Settings):
    from wicore.gateway.file_store import FilesConfig
    from wicore.gateway.state import GatewayConfig
    from wicore.producer import ProducerConfig

    producer = ProducerConfig(
        by_path=True,  # an image_path request is sent by reference; uploads and base64 travel as blobs
        notify=False,  # the gateway waits on result streams, not on a notification list
        result_ttl_s=settings.result_ttl_s,
        retries=settings.retries,
        max_image_bytes=settings.max_image_bytes,
        max_images_per_request=settings.max_images_per_request,
        max_queued_jobs=settings.max_queued_jobs,
        max_queued_high_jobs=settings.max_queued_high_jobs,
        release_blobs=True,  # blobs leave Redis with their last job, not a day later
        sampling=settings.sampling_limits,
    )
    return GatewayConfig(
        redis_url=settings.redis_url or "",
        model=model_dir_and_id(settings)[1],
        allowed_roots=tuple(Path(root).resolve() for root in settings.allowed_roots),
        api_keys=frozenset(key.get_secret_value() for key in settings.api_keys),
        max_request_bytes=settings.max_request_bytes,
        request_timeout_s=settings.request_timeout_s,
        stream_idle_timeout_s=settings.stream_idle_timeout_s,
        stream_cancel_on_disconnect=settings.stream_cancel_on_disconnect,
        producer=producer,
        files=FilesConfig(
            store=settings.files_store,
            folder=settings.files_dir,
            s3_url=settings.files_s3_url or "",
            s3_endpoint=settings.s3_endpoint,
            s3_timeout_s=settings.files_s3_timeout_s,
            max_bytes=settings.max_file_bytes,
        ),
        batch_window_s=settings.batch_window_s,
    )


@friendly_errors
def cancel(
    job_ids: list[str] = typer.Argument(..., help=ID_FILE_HELP),
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Cancel jobs: a queued job never runs, a running one stops at the engine's next step.
    Prints one JSON line per job with the status it ends in: canceled, or the status it had
    already ended with (null and an error for an id that names no job)."""
    from wicore.producer.shards import producer_over
    from wicore.producer.waiting import MISSING, no_such_job

    settings = settings_from(
        config, redis_url=redis_url, redis_password_file=redis_password_file, log_level=debug_level(debug)
    )
    producer = producer_over(connect_shards(settings.redis_urls), model="any")
    statuses = producer.cancel(list(read_job_ids(job_ids)))
    for job_id, status in statuses.items():
        line = {"job_id": job_id, "status": status}
        if status == MISSING:
            line = {"job_id": job_id, "status": None, "error": str(no_such_job(job_id))}
        typer.echo(json.dumps(line))
    if MISSING in statuses.values():
        raise typer.Exit(ExitCode.FAILED)
