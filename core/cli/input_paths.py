"""INPUT arguments of `wicore caption` / `wicore enqueue`: image files, folders (recursive) and
JSONL manifests, expanded into one item per image."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


@dataclass(frozen=True)
class InputItem:
    input: str  # as the user gave it; the key of its output line
    path: Path | None
    prompt: str | None = None
    max_new_tokens: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # known bad before any job is made (missing file, bad manifest line)


def expand_inputs(args: list[str]) -> Iterator[InputItem]:
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            yield from _folder(arg, path)
        elif path.suffix == ".jsonl" and path.is_file():
            yield from _manifest(path)
        elif path.is_file():
            yield InputItem(arg, path)
        else:
            yield InputItem(arg, None, error=f"InputError: {arg}: no such file or folder")


def _folder(arg: str, folder: Path) -> Iterator[InputItem]:
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
        yield InputItem(str(Path(arg) / path.relative_to(folder)), path)


def _manifest(manifest: Path) -> Iterator[InputItem]:
    """One JSON object per line: {"image": path (relative to the manifest), "prompt"?,
    "max_new_tokens"?, "input"? (the key of the output line; default the image path), ...rest
    is metadata}."""
    for number, line in enumerate(manifest.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{manifest}:{number}"
        try:
            entry = json.loads(line)
            image = entry.pop("image")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            yield InputItem(where, None, error=f"InputError: {where}: not a JSON object with an 'image' key")
            continue
        path = Path(image) if Path(image).is_absolute() else manifest.parent / image
        key = str(entry.pop("input", image))
        prompt, max_new = entry.pop("prompt", None), entry.pop("max_new_tokens", None)
        if not path.is_file():
            yield InputItem(key, None, error=f"InputError: {image}: no such file ({where})")
            continue
        yield InputItem(key, path, prompt=prompt, max_new_tokens=max_new, metadata=entry)
