"""Images by reference: hash the bytes, and either point at the file or ship the bytes once."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from pydantic import ValidationError

from wicore.errors import ImageError, ImageTooLarge
from wicore.redaction import masked_url
from wicore.schemas import ImageRef

URL_PREFIXES = ("http://", "https://", "s3://")

RAISE_BYTES = "; raise the setting max_image_bytes to allow it"


def read_bytes(path: Path, limit: int) -> bytes:
    """The file's bytes, at most `limit`. Only a regular file is read: the descriptor is opened
    without blocking (a FIFO would wait for a writer) and checked before any byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with os.fdopen(fd, "rb") as file:
        try:
            return _read_regular(file, path, limit)
        except OSError as exc:
            raise ImageError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _read_regular(file, path: Path, limit: int) -> bytes:
    info = os.fstat(file.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise ImageError(f"{path}: not a regular file")
    if info.st_size > limit:
        raise ImageTooLarge(f"{path}: {info.st_size} bytes is over the {limit}-byte limit{RAISE_BYTES}")
    data = file.read(limit + 1)  # the file may have grown since fstat
    if len(data) > limit:
        raise ImageTooLarge(f"{path}: over the {limit}-byte limit{RAISE_BYTES}")
    return data


def resolved(image: str | Path) -> Path:
    try:
        return Path(image).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ImageError(f"{image}: cannot be resolved ({exc})") from exc


def is_image_url(image: object) -> bool:
    """An http(s):// or s3:// URL (a str): the worker fetches it; the producer reads nothing."""
    return isinstance(image, str) and image[:8].lower().startswith(URL_PREFIXES)


def prepare_image(image: str | Path | bytes, *, by_path: bool, limit: int) -> tuple[ImageRef, bytes | None]:
    """(reference, bytes to store as a blob or None when the reference is a path or a URL)."""
    if not isinstance(image, str | Path | bytes | bytearray | memoryview):
        raise ImageError(f"image must be a file path, a URL or the image's bytes, got {type(image).__name__}")
    if is_image_url(image):
        try:
            return ImageRef(url=str(image)), None
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ImageError(f"image: {masked_url(str(image))}: {reason}") from None
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        if not data:
            raise ImageError("the image is empty (0 bytes)")
        if len(data) > limit:
            raise ImageTooLarge(f"image of {len(data)} bytes is over the {limit}-byte limit{RAISE_BYTES}")
        return ImageRef(sha256=hashlib.sha256(data).hexdigest()), data
    path = resolved(image)
    data = read_bytes(path, limit)
    sha = hashlib.sha256(data).hexdigest()
    if by_path:
        return ImageRef(sha256=sha, path=str(path)), None
    return ImageRef(sha256=sha), data
