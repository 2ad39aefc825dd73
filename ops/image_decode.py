"""Bytes -> a loaded RGB PIL image, with every limit checked before a pixel is decoded.

Every failure is one of ours (`ImageError`, `ImageTooLarge`) with a one-line message; no Pillow
exception type escapes. Orientation: EXIF is applied (transformers does not, so for a rotated
photo we give the model the upright image the user saw).
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from wicore import defaults
from wicore.errors import ConfigError, ImageError, ImageTooLarge
from wicore.ops.rgb import to_rgb


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = defaults.MAX_IMAGE_BYTES  # encoded size
    max_pixels: int = defaults.MAX_IMAGE_PIXELS  # per image, width * height, judged from the header

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1:
            raise ConfigError(f"image limits must be positive, got {self}")


DEFAULT_LIMITS = ImageLimits()

# Pillow warns past its own pixel limit, and raises past twice that, naming its limit. Ours,
# checked from the header, is the one a message names: its warning would only add a second one
# to the logs, and its error is reworded below.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
_PILLOW_PIXELS = re.compile(r"Image size \((\d+) pixels\)")


def _register_heif() -> bool:
    """HEIC / HEIF through pillow-heif (the `heif` extra) when installed; registered once, here."""
    try:
        from pillow_heif import register_heif_opener
    except ImportError:
        return False
    register_heif_opener()
    return True


HEIF_READABLE = _register_heif()
HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1")


def is_heif(data: bytes) -> bool:
    """An ISO-BMFF 'ftyp' box naming a HEIF brand."""
    return data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """A fully loaded RGB image: first frame, EXIF orientation applied, alpha composited onto white."""
    check_byte_size(len(data), limits)
    with _pillow_errors(data, limits), Image.open(io.BytesIO(data)) as image:
        _check_pixels(image.size, limits)  # header only: nothing is decoded yet
        image.load()  # the first frame of an animation
        ImageOps.exif_transpose(image, in_place=True)
        return to_rgb(image)


def read_image_file(path: str | os.PathLike[str], limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """The file's bytes; its size is checked before it is read."""
    path = Path(path)
    try:
        info = path.stat()
        _check_regular_file(info, path)
        check_byte_size(info.st_size, limits)
        with path.open("rb") as file:
            data = file.read(limits.max_bytes + 1)  # +1: notice a file that grew after stat
    except OSError as error:
        raise _file_error(error, path) from error
    check_byte_size(len(data), limits)
    return data


RAISE_BYTES = "; raise the setting max_image_bytes to allow it"
RAISE_PIXELS = "; raise the setting max_image_pixels to allow it"


def check_byte_size(num_bytes: int, limits: ImageLimits) -> None:
    if num_bytes == 0:
        raise ImageError("image is empty (0 bytes)")
    if num_bytes > limits.max_bytes:
        raise ImageTooLarge(f"image is {num_bytes:,} bytes, over the limit of {limits.max_bytes:,} bytes{RAISE_BYTES}")


def pixel_limit(limits: ImageLimits) -> int:
    """Ours, capped at Pillow's MAX_IMAGE_PIXELS: Pillow warns above it (and refuses at twice it),
    so staying under it means every image Pillow flags as a bomb is refused, by us."""
    pillow = Image.MAX_IMAGE_PIXELS
    return limits.max_pixels if pillow is None else min(limits.max_pixels, pillow)


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    limit = pixel_limit(limits)
    if width * height > limit:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height:,} pixels, over the limit of {limit:,} pixels{RAISE_PIXELS}"
        )


def _check_regular_file(info: os.stat_result, path: Path) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise ImageError(f"image path is a directory, not a file: {path}")
    if not stat.S_ISREG(info.st_mode):
        raise ImageError(f"image path is not a regular file: {path}")  # a FIFO would block the reader


def _file_error(error: OSError, path: Path) -> ImageError:
    if isinstance(error, FileNotFoundError):
        return ImageError(f"image file not found: {path}")
    if isinstance(error, PermissionError):
        return ImageError(f"no permission to read image file: {path}")
    if isinstance(error, IsADirectoryError):
        return ImageError(f"image path is a directory, not a file: {path}")
    return ImageError(f"cannot read image file {path}: {error.strerror or error}")


@contextmanager
def _pillow_errors(data: bytes, limits: ImageLimits) -> Iterator[None]:
    """Pillow's decoders raise many types on bad input (OSError, SyntaxError, ValueError,
    struct.error, EOFError, ...): each becomes one of ours. MemoryError is not the input's
    fault and passes through, as do our own errors."""
    try:
        yield
    except (ImageError, MemoryError):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        found = _PILLOW_PIXELS.search(str(error))
        size = f"{int(found[1]):,} pixels" if found else "too many pixels"
        limit = pixel_limit(limits)
        raise ImageTooLarge(f"image is {size}, over the limit of {limit:,} pixels{RAISE_PIXELS}") from error
    except UnidentifiedImageError as error:
        if is_heif(data) and not HEIF_READABLE:
            raise ImageError(
                "a HEIC/HEIF image: the worker needs pillow-heif to read it (pip install 'wicore[heif]')"
            ) from error
        raise ImageError(
            f"not an image Pillow can identify: unknown format or broken header (starts with {data[:8]!r})"
        ) from error
    except Exception as error:
        raise ImageError(f"corrupt or truncated image: {_one_line(error)}") from error


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
