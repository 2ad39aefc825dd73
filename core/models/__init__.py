"""Checkpoints wicore builds or ships. Light to import: builders import transformers lazily."""

from __future__ import annotations

from pathlib import Path

TINY_ID = "tiny"
DEMOCAP_ID = "democap"
DEMOCAP_DIR = Path(__file__).parent / "democap" / "checkpoint"  # shipped in the package (~2 MB)


def default_model(cache_dir: Path) -> tuple[Path, str]:
    """The model `wicore caption` uses without --model: the bundled demo captioner (one shape on a
    plain background; its model card is DEMOCAP_DIR / README.md). `cache_dir` is kept for
    checkpoints that are built on first use; this one is read in place."""
    if not (DEMOCAP_DIR / "config.json").is_file():
        from wicore.errors import ConfigError

        raise ConfigError(f"the bundled demo captioner is missing from {DEMOCAP_DIR}; reinstall wicore or pass --model")
    return DEMOCAP_DIR, DEMOCAP_ID
