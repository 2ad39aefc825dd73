"""What several verbs share: settings from flags, the model to serve, logging, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from wicore.cli.failures import friendly_errors  # noqa: F401 (every verb takes it from here)
from wicore.cli.logs import configure_logging
from wicore.config import Settings, load_settings, read_settings_file

# Messages on stderr; when that is a file or a pipe, lines are never wrapped at 80 columns.
console = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 1000)

ConfigOption = typer.Option(None, "--config", help="TOML settings file (also WICORE_CONFIG).", show_default=False)
RedisOption = typer.Option(None, "--redis-url", help="Redis URL (also WICORE_REDIS_URL).", show_default=False)
RedisPasswordFileOption = typer.Option(
    None,
    "--redis-password-file",
    help="File whose first line is the Redis password, when --redis-url carries none (also "
    "WICORE_REDIS_PASSWORD_FILE, or WICORE_REDIS_PASSWORD itself): it stays out of `ps`.",
    show_default=False,
)
ModelOption = typer.Option(
    None, "--model", help="Checkpoint directory (default: the bundled demo captioner).", show_default=False
)
ModelIdOption = typer.Option(
    None,
    "--model-id",
    help="Name jobs use for the model (default: the model directory's name; democap for the bundled model).",
    show_default=False,
)


def settings_from(
    config: Path | None, *, engine_option: list[str] | None = None, settings_file: Path | None = None, **flags
) -> Settings:
    """Settings from the flags given (None: not given) over the environment and the config file;
    or, for a process that `wicore caption` started, over its parent's settings file."""
    options = engine_options(engine_option)
    if settings_file is not None:
        settings = read_settings_file(settings_file, engine_options=options, **flags)
    else:
        settings = load_settings(config, engine_options=options, **flags)
    configure_logging(settings.log_level)
    return settings


def checked_model(settings: Settings, allow_random_weights: bool) -> tuple[Path, str]:
    """`model_dir_and_id`, after checking (cheaply: nothing loads) that the model directory and
    the engine name are usable, so a typo fails in a second rather than after a model load."""
    from wicore.engines import check_engine_name
    from wicore.engines.checkpoint import check_model_dir
    from wicore.models import model_dir_and_id

    model_dir, model_id = model_dir_and_id(settings)
    check_model_dir(model_dir, allow_random_weights=allow_random_weights)
    check_engine_name(settings.engine.name)
    return model_dir, model_id


AllowRandomWeightsOption = typer.Option(
    False, help="Run a checkpoint that has a config but no weights (random outputs: benchmarks only)."
)
DeviceOption = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: auto)", show_default=False)
DtypeOption = typer.Option(
    None,
    help="float32 | bfloat16 | float16 | fp8: bfloat16 with FP8 GEMMs (the fast engine on an Ada or Hopper GPU). "
    "Default: auto (bfloat16 on CUDA, float32 on CPU).",
    show_default=False,
)
BatchSizeOption = typer.Option(None, help="Most jobs in one engine batch [8].", show_default=False)
NoCacheOption = typer.Option(None, "--no-cache", help="Turn off the KV and vision caches.")
ImageColumnOption = typer.Option(
    None,
    help="Datasets: the column (WebDataset: the member extension) holding the image: bytes, a path or an s3:// URL "
    "(default: the first of image, img, jpg, jpeg, png, webp, image_bytes, bytes, path, image_path, file_name, url, "
    "image_url).",
    show_default=False,
)
KeyColumnOption = typer.Option(
    None,
    help="Datasets: the column keying each row's output line (default: key, __key__, id or input if present, "
    "else FILE:ROW).",
    show_default=False,
)
PromptColumnOption = typer.Option(
    "prompt", help="Datasets: the column (WebDataset: the member extension, e.g. txt) holding each input's prompt."
)
S3EndpointOption = typer.Option(
    None,
    "--s3-endpoint-url",
    help="S3-compatible endpoint for s3:// inputs (also WICORE_S3_ENDPOINT_URL, AWS_ENDPOINT_URL).",
    show_default=False,
)
EngineOption = typer.Option(
    None, "--engine-option", help="Engine option KEY=VALUE (VALUE as JSON, else a string); repeatable."
)


def dataset_options(settings: Settings, image_column: str | None, key_column: str | None, prompt_column: str):
    """How dataset INPUTs are read (input_paths.py, dataset_inputs.py)."""
    from wicore.cli.dataset_inputs import DatasetOptions

    return DatasetOptions(
        image_column=image_column,
        key_column=key_column,
        prompt_column=prompt_column,
        s3_endpoint_url=settings.s3_endpoint,
        max_image_bytes=settings.max_image_bytes,
    )


def engine_options(pairs: list[str] | None) -> dict:
    """['vision_batch_size=32', 'cuda_graphs=false'] -> {'vision_batch_size': 32, 'cuda_graphs': False}"""
    import json

    from wicore.errors import ConfigError

    options = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options
