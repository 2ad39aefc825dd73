"""One job's image, from where it lives to pixels: the bytes (a blob, or a file under an allowed
root), checked against the sha256 they were submitted with, decoded; and, for an engine that
takes its images resized (`Engine.pixel_spec`), resized to uint8 [H, W, 3].

The same functions run in a worker's threads and in its decode processes (`pixel_pool`), so a bad
image ends its job with the same one-line message either way (`input_error_message`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from wicore.errors import ImageError, ImageNotAllowed, JobInputError
from wicore.ops.image_decode import DEFAULT_LIMITS, ImageLimits, decode_image, read_image_file
from wicore.ops.image_preprocess import PreprocessSpec, resized_images


@dataclass(frozen=True)
class ImageSource:
    """Encoded bytes, or the path of a file that holds them (under one of the allowed roots)."""

    sha256: str  # hex digest the bytes must have
    data: bytes | None = None
    path: str | None = None


@dataclass(frozen=True)
class LoadRules:
    roots: tuple[Path, ...] = ()  # resolved; a path must resolve under one of them
    limits: ImageLimits = field(default_factory=lambda: DEFAULT_LIMITS)


def load_image(source: ImageSource, rules: LoadRules, fit: tuple[int, int] | None = None) -> Image.Image:
    """The decoded RGB image, shrunk on load when far larger than `fit` (`decode_image`); raises
    an `ImageError` (or another `JobInputError`)."""
    data = source.data if source.path is None else read_allowed_file(source.path, rules)
    if data is None:
        raise ImageError("image source has neither bytes nor a path")
    if hashlib.sha256(data).hexdigest() != source.sha256:
        raise ImageError("image bytes do not match the sha256 they were submitted with (file changed?)")
    return decode_image(data, rules.limits, fit)


def load_pixels(source: ImageSource, rules: LoadRules, spec: PreprocessSpec) -> tuple[np.ndarray | None, str, float]:
    """(uint8 [H, W, 3] resized for `spec`, "", seconds) or (None, the job's error message,
    seconds). Never raises for the input's sake: what crosses back from a decode process is
    an array and a string."""
    start = time.perf_counter()
    try:
        pixels = resized_images([load_image(source, rules, spec.size)], spec)[0]
    except Exception as error:  # whatever an input does to the decoders is that job's alone
        return None, input_error_message(error), time.perf_counter() - start
    return pixels, "", time.perf_counter() - start


def read_allowed_file(raw: str, rules: LoadRules) -> bytes:
    """The bytes of the file at `raw`, which must resolve under an allowed root."""
    try:
        path = Path(raw).resolve()
    except (ValueError, OSError, RuntimeError) as exc:  # a NUL byte, an unencodable name, a symlink loop
        raise ImageNotAllowed(f"{raw!r} is not a usable path ({exc})") from None
    if not any(path.is_relative_to(root) for root in rules.roots):
        raise ImageNotAllowed(f"{raw} is outside the worker's allowed roots (--allow-root)")
    return read_image_file(path, rules.limits)


def input_error_message(error: BaseException) -> str:
    """The job's error line: our input errors by name; anything else a loader raised is still
    the input's (an `ImageError`)."""
    if isinstance(error, JobInputError):
        return f"{type(error).__name__}: {error}"
    return f"{ImageError.__name__}: cannot load the image ({type(error).__name__}: {error})"
