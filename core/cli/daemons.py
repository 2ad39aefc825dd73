"""`wicore worker` and `wicore dashboard`: the long-running verbs."""

from __future__ import annotations

import uuid
from pathlib import Path

import typer

from wicore.cli.common import (
    AllowRandomWeightsOption,
    BatchSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    ModelIdOption,
    ModelOption,
    NoCacheOption,
    RedisOption,
    RedisPasswordFileOption,
    checked_model,
    console,
    friendly_errors,
    settings_from,
)
from wicore.cli.failures import DebugOption, debug_level
from wicore.cli.logs import configure_logging, level_or, quiet_progress_bars
from wicore.cli.redis_check import connect, connect_shards
from wicore.config import Settings
from wicore.errors import ConfigError
from wicore.redaction import redact

# `wicore worker`'s own options (the shared ones live in cli/common.py).
EngineNameOption = typer.Option(None, help="reference | fast | null (default: auto: fast on CUDA)", show_default=False)
MaxQueueDelayOption = typer.Option(None, help="Longest a partial batch waits to fill [5].", show_default=False)
HighLaneSlotsOption = typer.Option(
    None, min=0, help="Engine slots only high-priority jobs may take [batch size / 16].", show_default=False
)
AllowRootOption = typer.Option(None, help="Folder path-referenced images may come from (repeatable).")
DecodeProcessesOption = typer.Option(
    None,
    min=0,
    help="Processes decoding and resizing images; 0: threads. Default: on a GPU one per two cores of the "
    "worker's share of the host, at most 8; else 0.",
    show_default=False,
)
MetricsPortOption = typer.Option(
    None, help="Serve Prometheus /metrics and the /health/live, /health/ready probes on this port.", show_default=False
)
GpusOption = typer.Option(
    None, help="all, or GPU indices (0,1): one worker process per GPU, each pinned to it, kept running."
)
WorkersOption = typer.Option(None, min=1, help="N worker processes kept running (on CPU; --gpus on GPUs).")
SettingsFileOption = typer.Option(None, hidden=True, help="Settings from the parent (caption, --gpus).")


@friendly_errors
def worker(
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    engine: str = EngineNameOption,
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    batch_size: int = BatchSizeOption,
    max_queue_delay_ms: float = MaxQueueDelayOption,
    high_lane_slots: int = HighLaneSlotsOption,
    allow_root: list[Path] = AllowRootOption,
    decode_processes: int = DecodeProcessesOption,
    name: str = typer.Option(None, help="Worker name (default: random)."),
    burst: bool = typer.Option(False, help="Exit once the queues are empty."),
    max_jobs: int = typer.Option(None, help="Exit after this many jobs."),
    metrics_port: int = MetricsPortOption,
    no_cache: bool = NoCacheOption,
    engine_option: list[str] = EngineOption,
    allow_random_weights: bool = AllowRandomWeightsOption,
    config: Path = ConfigOption,
    debug: bool = DebugOption,
    gpus: str = GpusOption,
    workers: int = WorkersOption,
    settings_file: Path = SettingsFileOption,
    redis_shard: int = typer.Option(
        None, min=0, help="Of a sharded --redis-url, the shard (0, 1, ...) this worker serves.", show_default=False
    ),
) -> None:
    """Serve caption jobs from Redis: take batches by shape bucket, run them, write results.
    Logs one INFO line per batch and one WARNING per failed job (WICORE_LOG_LEVEL=warning: fewer).
    With --gpus or --workers: worker processes named NAME-gpuI (NAME-I), each restarted when it
    crashes; SIGTERM stops them all (twice: at once, their jobs back in the queues)."""
    settings = settings_from(
        config,
        engine_option=engine_option,
        settings_file=settings_file,
        redis_url=redis_url,
        redis_password_file=redis_password_file,
        model=model,
        model_id=model_id,
        engine=engine,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_queue_delay_ms=max_queue_delay_ms,
        high_lane_slots=high_lane_slots,
        allowed_roots=allow_root or None,
        decode_processes=decode_processes,
        no_cache=no_cache,
        metrics_port=metrics_port,
        log_level=debug_level(debug),
    )
    if redis_shard is not None:
        settings = one_shard(settings, redis_shard)
    if gpus is not None or workers is not None:
        flags = worker_flags(allow_random_weights=allow_random_weights, burst=burst, max_jobs=max_jobs)
        raise typer.Exit(supervised(settings, name or uuid.uuid4().hex[:8], gpus, workers, flags))
    serve_jobs(settings, name, allow_random_weights=allow_random_weights, burst=burst, max_jobs=max_jobs)


def one_shard(settings: Settings, index: int) -> Settings:
    """The settings of a worker that serves shard `index` of a sharded redis_url."""
    urls = settings.redis_urls
    if index >= len(urls):
        raise ConfigError(f"--redis-shard {index}: --redis-url lists {len(urls)} shards (0 to {len(urls) - 1})")
    return settings.model_copy(update={"redis_url": urls[index]})


def serve_jobs(
    settings: Settings, name: str | None, *, allow_random_weights: bool, burst: bool, max_jobs: int | None
) -> None:
    """One worker in this process: check the model and Redis, load the engine, serve until stopped."""
    configure_logging(level_or(settings, "INFO"))  # a worker's log is its output
    quiet_progress_bars()
    model_dir, served_id = checked_model(settings, allow_random_weights)
    from wicore.worker.redis_link import client_options

    if len(settings.redis_urls) > 1:
        raise ConfigError(
            "a worker serves one shard: give --redis-url one URL, --redis-shard INDEX, or --gpus/--workers "
            "to spread worker processes over the shards"
        )
    # Checked before the model loads (a bad URL fails in a second); a client that notices outages.
    connection = connect(settings.redis_url, **client_options())
    from wicore.worker.factory import build_engine, build_worker

    health = probes(settings, name)
    engine_obj = build_engine(settings, model_dir)
    from wicore.gc_pauses import PAUSES, freeze_startup_heap

    freeze_startup_heap()  # a full collection would walk the model's objects, stalling the engine
    PAUSES.install()
    worker_obj = build_worker(settings, connection, engine_obj, served_id, name=name, burst=burst, max_jobs=max_jobs)
    fp8 = " with FP8 GEMMs" if engine_obj.config.options.gemm_dtype == "fp8" else ""
    where = f"{engine_obj.name} engine on {engine_obj.config.device} ({engine_obj.config.dtype}{fp8})"
    console.print(
        f"worker {worker_obj.name}: serving model {served_id} ({model_dir}), {where}{ready(engine_obj)}", markup=False
    )
    if health is not None:
        health.loaded(worker_obj)
    done = run_sampled(worker_obj, settings.sample_stacks)
    engine_obj.close()  # lets the caches write what they hold back (the shared vision cache writes behind)
    console.print(f"worker {worker_obj.name}: {done} jobs done, stopped", markup=False)


def probes(settings: Settings, name: str | None):
    """With --metrics-port: /metrics and the health probes (worker/probes.py), open while the
    model loads (ready once it has); else None."""
    if settings.metrics_port is None:
        return None
    from wicore.worker.probes import WorkerHealth, serve_probes

    health = WorkerHealth(settings.redis_url or "")
    serve_probes(health, settings.metrics_port, settings.host)
    where = f"http://{settings.host}:{settings.metrics_port}"
    console.print(
        f"worker {name or ''}: metrics on {where}/metrics, probes on {where}/health/{{live,ready}}", markup=False
    )
    return health


def ready(engine_obj) -> str:
    """', ready in 41.2 s' from the engine's stats (time to ready: load, compile, graph capture;
    the engine's INFO log has the phases); empty for engines that do not time their start."""
    seconds = engine_obj.stats().get("ready_s")
    return "" if seconds is None else f", ready in {seconds:.1f} s"


def run_sampled(worker_obj, stacks: Path | None) -> int:
    """Run the worker; with `stacks`, sample its loop thread and write the report there."""
    if stacks is None:
        return worker_obj.run()
    from wicore.stack_sampler import StackSampler

    sampler = StackSampler()
    try:
        with sampler:
            return worker_obj.run()
    finally:
        sampler.write(stacks)


def worker_flags(*, allow_random_weights: bool, burst: bool, max_jobs: int | None) -> list[str]:
    """The flags each supervised worker takes beyond its settings file."""
    flags = []
    if allow_random_weights:
        flags.append("--allow-random-weights")
    if burst:
        flags.append("--burst")
    if max_jobs is not None:
        flags += ["--max-jobs", str(max_jobs)]
    return flags


def supervised(settings: Settings, base: str, gpus: str | None, workers: int | None, flags: list[str]) -> int:
    """`worker --gpus/--workers`: what can fail in a second fails here (the flags, the model
    folder, Redis), before any worker loads a model; then the supervisor runs them."""
    from wicore.cli.supervisor import supervise
    from wicore.cli.worker_specs import plan_workers

    specs = plan_workers(base, settings, gpus=gpus, workers=workers)
    model_dir, served_id = checked_model(settings, "--allow-random-weights" in flags)
    for connection in connect_shards(settings.redis_urls):
        connection.close()
    return supervise(settings.model_copy(update={"model": model_dir, "model_id": served_id}), specs, flags)


@friendly_errors
def dashboard(
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(9181, help="Port to listen on."),
    auth: str = typer.Option(
        None, help="Require HTTP basic auth USER:PASSWORD (also WICORE_DASHBOARD_AUTH).", show_default=False
    ),
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """rq-dashboard on the same Redis, reading wicore's jobs as JSON only; write actions need
    the page's token, and every page the login when --auth is given."""
    settings = settings_from(
        config,
        redis_url=redis_url,
        redis_password_file=redis_password_file,
        dashboard_auth=auth,
        log_level=debug_level(debug),
    )
    credentials = settings.dashboard_auth.get_secret_value() if settings.dashboard_auth else None
    if credentials is None and not is_loopback(host):
        raise ConfigError(
            f"listening on {host} without --auth would open the queues to the network: add --auth USER:PASS"
        )
    for connection in connect_shards(settings.redis_urls, write=False):
        connection.close()
    from wicore.worker.dashboard import BasicAuth, make_app, serve

    app = make_app(settings.redis_url, BasicAuth.parse(credentials) if credentials else None)
    console.print(f"dashboard on http://{host}:{port}/ for {redact(settings.redis_url)}", markup=False)
    serve(app, host, port)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
