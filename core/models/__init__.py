"""Checkpoints wicore builds or ships. Light to import: builders import transformers lazily."""

from __future__ import annotations

from pathlib import Path

TINY_ID = "tiny"


def default_model(cache_dir: Path) -> tuple[Path, str]:
    """The model `wicore caption` uses without --model: the tiny random Gemma-3, built once
    into the cache folder (until the bundled demo captioner ships)."""
    path = Path(cache_dir) / "models" / TINY_ID
    if not (path / "config.json").is_file():
        from wicore.models.gemma3 import make_tiny

        make_tiny(path)
    return path, TINY_ID
