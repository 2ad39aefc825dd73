"""Checkpoints wicore builds or ships. Light to import: builders import transformers lazily."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wicore.config import Settings

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


def model_dir_and_id(settings: Settings) -> tuple[Path, str]:
    """The checkpoint to serve and the id jobs name it by."""
    if settings.model is None:
        path, default_id = default_model(settings.cache_dir)
    else:
        path, default_id = settings.model, model_id_of(settings.model)
    return path, settings.model_id or default_id


def model_id_of(model_dir: Path) -> str:
    """A queue-safe id from the directory name (letters, digits, '_' and '-'); the bundled model
    keeps its own id however its folder is named, so producer and worker agree on it."""
    if Path(model_dir).resolve() == DEMOCAP_DIR.resolve():
        return DEMOCAP_ID
    name = "".join(c if c.isalnum() or c in "_-" else "-" for c in Path(model_dir).resolve().name).strip("-_")
    return name or "model"
