"""Settings -> engine and worker. Resolves the `auto` choices: CUDA when present, bfloat16 on
CUDA and float32 on CPU, the fast engine on CUDA and the reference engine on CPU."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from redis import Redis

from wicore.config import Settings
from wicore.defaults import gpu_decode_processes
from wicore.engines import Engine, EngineConfig, create_engine
from wicore.engines.options import FastOptions
from wicore.errors import ConfigError
from wicore.ops.image_decode import ImageLimits
from wicore.ops.image_fetch import UrlPolicy
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import GenerationParams
from wicore.worker.job_inputs import InputConfig
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    return device


def check_device(device: str) -> None:
    """A device torch can name, and for CUDA one that is here."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device}: not a device name; use cpu, cuda, cuda:N or auto") from exc
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
        raise ConfigError(f"--device {device}: no CUDA device here ({build}); use --device cpu or auto")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "fp8":
        return "bfloat16"  # the activations'; the GEMMs' is the engine option gemm_dtype (`fast_options`)
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def fast_options(settings: Settings) -> FastOptions:
    """The engine's options, with `--dtype fp8` turned into gemm_dtype = "fp8"."""
    options = settings.engine.options()
    return options.model_copy(update={"gemm_dtype": "fp8"}) if settings.dtype == "fp8" else options


def resolve_engine(engine: str, device: str) -> str:
    if engine != "auto":
        return engine
    return "fast" if device.startswith("cuda") else "reference"


def build_engine(settings: Settings, model_dir: Path) -> Engine:
    device = resolve_device(settings.device)
    config = EngineConfig(
        model_dir=str(model_dir),
        device=device,
        dtype=resolve_dtype(settings.dtype, device),
        max_batch_size=settings.batch_size,
        cache=not settings.no_cache,
        options=fast_options(settings),
    )
    engine = resolve_engine(settings.engine.name, device)
    if config.options.gemm_dtype == "fp8" and engine != "fast":
        raise ConfigError(
            f"FP8 GEMMs (--dtype fp8) need the fast engine on an Ada or Hopper GPU, not the {engine} engine on "
            f"{device}: use --dtype bfloat16 (or --engine fast --device cuda on such a GPU)"
        )
    return create_engine(engine, config)


def attach_shared_caches(settings: Settings, connection: Redis, engine: Engine, model_id: str) -> None:
    """Image embeddings shared through Redis by every worker of this model, unless caching is off."""
    if settings.no_cache or not settings.vision_cache_redis_bytes:
        return
    from wicore.worker.shared_vision_cache import RedisVisionCache

    tag = fast_options(settings).numerics_tag()  # FP8 embeddings differ from bf16's: kept apart
    store = RedisVisionCache(
        connection,
        namespace=f"{model_id}-{tag}" if tag else model_id,
        max_bytes=settings.vision_cache_redis_bytes,
        ttl_s=settings.vision_cache_ttl_s,
    )
    engine.attach_vision_cache(store)


def decode_processes(settings: Settings, engine: Engine) -> int:
    """Processes that read, decode and resize images, for an engine that takes them resized: as
    set, else on a GPU one per two cores (`defaults.gpu_decode_processes`; `wicore worker --gpus`
    gives each worker its share of the host), else none: threads. In threads the work shares its
    GIL with the launching thread, and the device idles longer at a bulk run's start."""
    if engine.pixel_spec() is None:
        return 0  # the engine resizes: images decode in threads
    if settings.decode_processes is not None:
        return settings.decode_processes
    return gpu_decode_processes(os.cpu_count() or 2) if engine.describe().get("cuda") is True else 0


def build_worker(
    settings: Settings,
    connection: Redis,
    engine: Engine,
    model_id: str,
    *,
    name: str | None = None,
    burst: bool = False,
    max_jobs: int | None = None,
) -> BatchingWorker:
    inputs = InputConfig(
        allowed_roots=tuple(Path(r) for r in settings.allowed_roots),
        limits=ImageLimits(settings.max_image_bytes, settings.max_image_pixels, settings.decode_budget_bytes),
        processes=decode_processes(settings, engine),
        urls=url_policy(settings),
        generation_defaults=generation_defaults(settings, Path(engine.config.model_dir)),
        max_images_per_request=settings.max_images_per_request,
        sampling=settings.sampling_limits,
    )
    attach_shared_caches(settings, connection, engine, model_id)
    log_config(settings, engine, inputs)
    config = WorkerConfig(
        model_id=model_id,
        name=name,
        policy=BatchPolicy(
            max_batch_size=settings.batch_size,
            max_queue_delay_s=settings.max_queue_delay_ms / 1000,
            high_lane_slots=settings.high_lane_slots,
        ),
        inputs=inputs,
        liveness_ttl_s=settings.liveness_ttl_s,
        heartbeat_s=min(3.0, settings.liveness_ttl_s / 3),
        result_ttl_s=settings.result_ttl_s,
        burst=burst,
        max_jobs=max_jobs,
    )
    return BatchingWorker(connection, engine, config)


def url_policy(settings: Settings) -> UrlPolicy:
    return UrlPolicy(
        allow_private=settings.allow_private_urls,
        allow_hosts=tuple(settings.url_allow_hosts),
        deny_hosts=tuple(settings.url_deny_hosts),
        connect_timeout_s=settings.url_connect_timeout_s,
        timeout_s=settings.url_timeout_s,
        max_redirects=settings.url_max_redirects,
        s3_endpoint_url=settings.s3_endpoint,
    )


GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")  # those vLLM takes too


def generation_defaults(settings: Settings, model_dir: Path) -> dict[str, Any]:
    """The sampling defaults of the checkpoint's generation_config.json ({} when the setting
    generation_config is none, or the checkpoint has none); logged, so the worker's log says which
    defaults its jobs get. A value wicore cannot take is a configuration error."""
    path = model_dir / "generation_config.json"
    if settings.generation_config == "none" or not path.is_file():
        reason = "generation_config = none" if settings.generation_config == "none" else f"no {path.name}"
        log.info("generation defaults: wicore's own (%s)", reason)
        return {}
    found = _generation_keys(path)
    try:
        GenerationParams.model_validate(found)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, GenerationParams, f"value in {path}") from None
    log.info("generation defaults from %s: %s (set generation_config = none to ignore it)", path, json.dumps(found))
    if found.get("temperature", 0) > 0:
        log.warning(
            "requests that leave temperature unset sample at %s, yet are deduplicated as their own fields read: "
            "a producer sets temperature (and no seed) for a fresh sample each time",
            found["temperature"],
        )
    return found


def _generation_keys(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return {key: raw[key] for key in GENERATION_CONFIG_KEYS if raw.get(key) is not None}


def log_config(settings: Settings, engine: Engine, inputs: InputConfig) -> None:
    """The configuration a worker runs with, once at start: the settings (credentials masked),
    the engine's and the worker's, every device-dependent default resolved."""
    config = {
        "settings": settings.public(),
        "engine": engine.describe(),
        "worker": {"decode_processes": inputs.processes},
    }
    log.info("config: %s", json.dumps(config, sort_keys=True))
