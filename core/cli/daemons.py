"""`wicore worker` and `wicore dashboard`: the long-running verbs."""

from __future__ import annotations

from pathlib import Path

import typer
from redis import Redis

from wicore.cli.common import (
    BatchSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    ModelIdOption,
    ModelOption,
    NoCacheOption,
    RedisOption,
    console,
    engine_options,
    friendly_errors,
    model_dir_and_id,
    settings_from,
)
from wicore.errors import ConfigError


@friendly_errors
def worker(
    redis_url: str = RedisOption,
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    engine: str = typer.Option(None, help="reference | fast | null (default: auto: fast on CUDA)", show_default=False),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    batch_size: int = BatchSizeOption,
    max_queue_delay_ms: float = typer.Option(
        None, help="Longest a partial batch waits to fill [5].", show_default=False
    ),
    allow_root: list[Path] = typer.Option(None, help="Folder path-referenced images may come from (repeatable)."),
    name: str = typer.Option(None, help="Worker name (default: random)."),
    burst: bool = typer.Option(False, help="Exit once the queues are empty."),
    max_jobs: int = typer.Option(None, help="Exit after this many jobs."),
    metrics_port: int = typer.Option(None, help="Serve Prometheus /metrics on this port.", show_default=False),
    no_cache: bool = NoCacheOption,
    engine_option: list[str] = EngineOption,
    config: Path = ConfigOption,
) -> None:
    """Serve caption jobs from Redis: take batches by shape bucket, run them, write results."""
    settings = settings_from(
        config,
        redis_url=redis_url,
        model=model,
        model_id=model_id,
        engine=engine,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_queue_delay_ms=max_queue_delay_ms,
        allowed_roots=allow_root or None,
        no_cache=no_cache,
        metrics_port=metrics_port,
    )
    if not settings.redis_url:
        raise ConfigError("wicore worker needs --redis-url or WICORE_REDIS_URL")
    from wicore.worker.factory import build_engine, build_worker

    model_dir, served_id = model_dir_and_id(settings)
    engine_obj = build_engine(settings, model_dir, engine_options(engine_option))
    connection = Redis.from_url(settings.redis_url)
    worker_obj = build_worker(settings, connection, engine_obj, served_id, name=name, burst=burst, max_jobs=max_jobs)
    console.print(f"worker [bold]{worker_obj.name}[/bold]: model {served_id} ({model_dir}) on {engine_obj.name}")
    if settings.metrics_port is not None:
        worker_obj.metrics.serve(settings.metrics_port, settings.host)
        console.print(f"metrics on http://{settings.host}:{settings.metrics_port}/metrics")
    done = worker_obj.run()
    console.print(f"worker {worker_obj.name}: {done} jobs done, stopped")


@friendly_errors
def dashboard(
    redis_url: str = RedisOption,
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(9181, help="Port to listen on."),
    config: Path = ConfigOption,
) -> None:
    """rq-dashboard on the same Redis, reading wicore's JSON-serialized jobs."""
    settings = settings_from(config, redis_url=redis_url)
    if not settings.redis_url:
        raise ConfigError("wicore dashboard needs --redis-url or WICORE_REDIS_URL")
    from wicore.worker.dashboard import make_app

    console.print(f"rq-dashboard on http://{host}:{port}/ for {settings.redis_url}")
    make_app(settings.redis_url).run(host=host, port=port)
