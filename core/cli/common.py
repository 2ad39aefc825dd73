"""What several verbs share: settings from flags, the model to serve, logging, errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import typer
from rich.console import Console

from wicore.config import Settings, load_settings, read_settings_file
from wicore.errors import WicoreError

console = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", help="TOML settings file (also WICORE_CONFIG).", show_default=False)
RedisOption = typer.Option(None, "--redis-url", help="Redis URL (also WICORE_REDIS_URL).", show_default=False)
ModelOption = typer.Option(
    None, "--model", help="Checkpoint directory (default: the bundled demo captioner).", show_default=False
)
ModelIdOption = typer.Option(
    None, "--model-id", help="Name jobs use for the model (default: from the directory).", show_default=False
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
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    return settings


def model_dir_and_id(settings: Settings) -> tuple[Path, str]:
    """The checkpoint to serve and the id jobs name it by."""
    from wicore.models import default_model

    if settings.model is None:
        path, default_id = default_model(settings.cache_dir)
    else:
        path, default_id = settings.model, model_id_of(settings.model)
    return path, settings.model_id or default_id


def model_id_of(model_dir: Path) -> str:
    """A queue-safe id from the directory name: letters, digits, '_' and '-'."""
    name = "".join(c if c.isalnum() or c in "_-" else "-" for c in Path(model_dir).resolve().name).strip("-_")
    return name or "model"


DeviceOption = typer.Option(None, help="cpu, cuda, cuda:1 ... (default: auto)", show_default=False)
DtypeOption = typer.Option(None, help="float32 | bfloat16 | float16 (default: auto)", show_default=False)
BatchSizeOption = typer.Option(None, help="Most jobs in one engine batch [8].", show_default=False)
NoCacheOption = typer.Option(None, "--no-cache", help="Turn off the KV and vision caches.")
EngineOption = typer.Option(
    None, "--engine-option", help="Engine option KEY=VALUE (VALUE as JSON, else a string); repeatable."
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


def friendly_errors(command: Callable) -> Callable:
    """Our own errors print one clear line and exit 2, not a traceback."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except WicoreError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None

    return wrapper
