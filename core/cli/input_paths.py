"""INPUT arguments of `wicore caption` / `wicore enqueue`: image files, http(s):// and s3:// image
URLs (a worker fetches them), folders (recursive), JSONL manifests (one `ManifestEntry` per line)
and datasets (Parquet, WebDataset shards, `datasets` folders, s3:// prefixes: dataset_inputs.py),
expanded lazily into one item per input. Every file in a folder is an input (hidden ones aside): a
file that is not an image gets an error item, so it still gets its line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wicore.cli.dataset_inputs import DatasetOptions, Row, dataset_rows, is_dataset, missing, require_extras
from wicore.errors import ConfigError
from wicore.grammars import grammar_problem
from wicore.producer.image_refs import is_image_url
from wicore.redaction import masked_url
from wicore.schemas import ChatMessage, GenerationParams, ManifestEntry, image_url

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif"}
MANIFEST_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class InputItem:
    input: str  # as the user gave it; the key of its output line
    path: Path | None
    prompt: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # the generation parameters the line set
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # known bad before any job is made (not an image, bad manifest line)
    url: str | None = None  # an image a worker fetches, instead of a path
    data: bytes | None = None  # the image's bytes, for an image read from a dataset
    messages: tuple[ChatMessage, ...] | None = None  # a manifest line's conversation (`path` is then None)
    images: tuple[Path | str, ...] = ()  # the conversation's image parts, in order: files, or URLs a worker fetches

    @property
    def image(self) -> Path | str | bytes | None:
        """What the job is made from: the bytes, else the URL, else the file."""
        if self.data is not None:
            return self.data
        return self.url if self.url is not None else self.path

    def generation(self, flags: dict[str, Any]) -> GenerationParams:
        """The command's parameters (`flags`, the ones given) with this line's on top."""
        return GenerationParams.model_validate({**flags, **self.params})

    @property
    def files(self) -> tuple[Path, ...]:
        """The local files the item names (its URLs aside)."""
        named = self.images if self.path is None else (self.path, *self.images)
        return tuple(image for image in named if isinstance(image, Path))


def is_url_input(arg: str) -> bool:
    """An INPUT a worker fetches: an http(s) URL, or an s3:// object named like an image (other
    s3:// INPUTs are prefixes and dataset files, read here)."""
    if not is_image_url(arg):
        return False
    return not arg.lower().startswith("s3://") or Path(arg).suffix.lower() in IMAGE_SUFFIXES


def iter_inputs(args: list[str], options: DatasetOptions | None = None) -> Iterator[InputItem]:
    """One item per input, each input once (the first occurrence wins), read as they are used.
    A missing argument is a usage error, raised here, before anything starts."""
    options = options or DatasetOptions()
    local = [arg for arg in args if not is_url_input(arg)]
    datasets = [arg for arg in local if is_dataset(arg, options.store)]
    require_extras(datasets)
    absent = missing(datasets, options.store) + [a for a in local if a not in datasets and not Path(a).exists()]
    if absent:
        raise ConfigError(f"no such file or folder: {', '.join(a for a in args if a in absent)}")
    return _unique(item for arg in args for item in _expand(arg, arg in datasets, options))


def expand_inputs(args: list[str], options: DatasetOptions | None = None) -> list[InputItem]:
    return list(iter_inputs(args, options))


@dataclass(frozen=True)
class LocalFiles:
    """The local image files, folders and manifests among the INPUTs, surveyed before a run."""

    roots: set[Path]  # the folders of their image files (a dataset's images travel as bytes)
    todo: int | None  # inputs still to run when every INPUT is local; None: datasets are counted as read


def local_files(args: list[str], options: DatasetOptions, settled: set[str]) -> LocalFiles:
    files = [arg for arg in args if not is_url_input(arg) and not is_dataset(arg, options.store)]
    roots: set[Path] = set()
    todo = 0
    for item in iter_inputs(files, options):
        todo += item.input not in settled
        roots.update(path.resolve().parent for path in item.files)
    return LocalFiles(roots, todo if len(files) == len(args) else None)


def _unique(items: Iterable[InputItem]) -> Iterator[InputItem]:
    seen: set[str] = set()
    for item in items:
        if item.input not in seen:
            seen.add(item.input)
            yield item


def _expand(arg: str, dataset: bool, options: DatasetOptions) -> Iterator[InputItem]:
    path = Path(arg)
    if is_url_input(arg):
        yield _url_item(arg, arg)
    elif dataset:
        yield from map(_dataset_item, dataset_rows(arg, options))
    elif path.is_dir():
        yield from _folder(arg, path)
    elif path.suffix.lower() == MANIFEST_SUFFIX:
        yield from _manifest(path)
    else:
        yield _file(arg, path)


def _dataset_item(row: Row) -> InputItem:
    return InputItem(row.key, None, prompt=row.prompt, metadata=row.metadata or {}, error=row.error, data=row.data)


def _file(key: str, path: Path) -> InputItem:
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        kinds = " ".join(sorted(IMAGE_SUFFIXES))
        return InputItem(key, None, error=f"InputError: {key}: not an image file (supported: {kinds})")
    return InputItem(key, path)


def _folder(arg: str, folder: Path) -> Iterator[InputItem]:
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            yield _file(str(Path(arg) / relative), path)


def _manifest(manifest: Path) -> Iterator[InputItem]:
    """One JSON object per line (`wicore schema manifest`); `image` is relative to the manifest."""
    for number, line in enumerate(manifest.read_text().splitlines(), start=1):
        if line.strip():
            yield _manifest_line(f"{manifest}:{number}", manifest.parent, line)


def _manifest_line(where: str, folder: Path, line: str) -> InputItem:
    entry = _entry(line)
    if isinstance(entry, str):
        return InputItem(
            where, None, error=f"InputError: {where}: not a manifest line ({entry}; see `wicore schema manifest`)"
        )
    named = entry.images
    key = entry.input or (named[0] if named else where)
    try:
        generation = entry.generation()
    except ValidationError as exc:
        return InputItem(key, None, error=f"InputError: {where}: {validation_line(exc)}")
    problem = None if generation.guided is None else grammar_problem(generation.guided)
    if problem is not None:
        return InputItem(key, None, error=f"InputError: {where}: guided: {problem}")
    params = generation.model_dump(exclude_unset=True)
    try:
        images = [_manifest_image(image, folder, where) for image in named]
    except ValueError as exc:
        return InputItem(key, None, error=f"InputError: {exc}")
    item = InputItem(key, None, prompt=entry.prompt, params=params, metadata=entry.metadata)
    if entry.messages is not None:
        return replace(item, messages=tuple(m.chat_message() for m in entry.messages), images=tuple(images))
    if not images:
        return item
    first = images[0]
    return replace(item, url=first) if isinstance(first, str) else replace(item, path=first)


def _manifest_image(image: str, folder: Path, where: str) -> Path | str:
    """A manifest line's image: a URL (checked, not fetched) or a file that exists. Raises
    ValueError saying what is wrong with it."""
    if is_image_url(image):
        try:
            return image_url(image)
        except ValueError as exc:
            raise ValueError(f"{masked_url(image)}: {exc}") from None
    path = Path(image) if Path(image).is_absolute() else folder / image
    if not path.is_file():
        raise ValueError(f"{image}: no such file ({where})")
    return path


def _url_item(key: str, url: str) -> InputItem:
    try:
        return InputItem(key, None, url=image_url(url))
    except ValueError as exc:
        return InputItem(key, None, error=f"InputError: {masked_url(url)}: {exc}")


def _entry(line: str) -> ManifestEntry | str:
    """The line's entry, or what is wrong with it."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg}"
    if not isinstance(raw, dict):
        return "not a JSON object"
    try:
        return ManifestEntry.model_validate(raw)
    except ValidationError as exc:
        return validation_line(exc)


def validation_line(exc: ValidationError) -> str:
    """The deepest of a validation's errors in one line, without pydantic's union branch names
    ("messages.0.content.0.image: Field required"); an unknown top-level key says where such
    keys go."""
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    parts = [str(p) for p in error["loc"] if not (isinstance(p, str) and "[" in p)]
    where = ".".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])  # a tagged union repeats its tag
    if error["type"] == "extra_forbidden" and len(parts) == 1:
        return f"{where}: unknown key (put your own keys under metadata)"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
