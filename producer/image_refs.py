"""Images by reference: hash the bytes, and either point at the file or ship the bytes once."""

from __future__ import annotations

import hashlib
from pathlib import Path

from wicore.errors import ImageError, ImageTooLarge
from wicore.schemas import ImageRef

RAISE_BYTES = "; raise the setting max_image_bytes to allow it"


def read_bytes(path: Path, limit: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise ImageTooLarge(f"{path}: {size} bytes is over the {limit}-byte limit{RAISE_BYTES}")
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def prepare_image(image: str | Path | bytes, *, by_path: bool, limit: int) -> tuple[ImageRef, bytes | None]:
    """(reference, bytes to store as a blob or None when the reference is a path)."""
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        if len(data) > limit:
            raise ImageTooLarge(f"image of {len(data)} bytes is over the {limit}-byte limit{RAISE_BYTES}")
        return ImageRef(sha256=hashlib.sha256(data).hexdigest()), data
    path = Path(image).resolve()
    data = read_bytes(path, limit)
    sha = hashlib.sha256(data).hexdigest()
    if by_path:
        return ImageRef(sha256=sha, path=str(path)), None
    return ImageRef(sha256=sha), data
