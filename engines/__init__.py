"""Engines by name, imported lazily: an engine's optional dependencies cost nothing until it is
chosen. Engines never import Redis or RQ.

There is no TensorRT engine: no machine this project runs on can install TensorRT's builder
(PyPI's full `tensorrt` packages are source distributions that fetch the wheels from an index
these machines cannot reach; the lean and dispatch runtimes cannot build engines; TensorRT-RTX
does not support Hopper). One would register here by name like the others."""

from __future__ import annotations

import importlib

from wicore.engines.base import Completion, Engine, EngineConfig, EngineRequest
from wicore.errors import ConfigError

ENGINES = {
    "reference": "wicore.engines.reference:ReferenceEngine",
    "fast": "wicore.engines.fast.engine:FastEngine",
    "null": "wicore.engines.null:NullEngine",
}


def check_engine_name(name: str) -> None:
    """Cheap (imports no engine): the CLI checks the name before it starts anything slow."""
    if name != "auto" and name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}; choose one of auto, {', '.join(sorted(ENGINES))}")


def engine_class(name: str) -> type[Engine]:
    check_engine_name(name)
    module_name, class_name = ENGINES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"engine {name!r} is not available here: {exc}") from exc
    return getattr(module, class_name)


def create_engine(name: str, config: EngineConfig) -> Engine:
    return engine_class(name)(config)


__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "check_engine_name",
    "create_engine",
    "engine_class",
]
