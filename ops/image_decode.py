"""Bytes -> a loaded RGB PIL image, with every limit checked before a pixel is decoded.

Every failure is one of ours (`ImageError`, `ImageTooLarge`) with a one-line message; no Pillow
exception type escapes. Orientation: EXIF is applied (transformers does not, so for a rotated
photo we give the model the upright image the user saw).

Memory: a decode waits for its share of its `DecodeBudget` (a worker's threads, or its decode
processes, share one). Given the size the image will be resized to (`fit`), an image more than
`REDUCING_GAP` times larger on an axis is shrunk on load by whole factors to no less than
`REDUCING_GAP` times it: a JPEG in its decoder (DCT scaling, `Image.draft`), any image by box
averaging (`Image.reduce`) right after it is decoded, before its mode is converted or it is
turned upright, so no further full-size copy is made (a palette or a transparency key becomes
RGBA first); the full-size buffer is freed before the decode's share of the budget is.
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from wicore import defaults
from wicore.errors import ConfigError, ImageError, ImageTooLarge
from wicore.ops.decode_budget import budget_of
from wicore.ops.rgb import deep_gray_to_l, has_alpha, is_deep_gray, to_rgb


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = defaults.MAX_IMAGE_BYTES  # encoded size
    max_pixels: int = defaults.MAX_IMAGE_PIXELS  # per image, width * height, judged from the header
    # full-size pixel memory decodes sharing a budget hold at once (`working_bytes`,
    # `decode_budget`); one image that needs more decodes alone
    budget_bytes: int = defaults.DECODE_BUDGET_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1 or self.budget_bytes < 1:
            raise ConfigError(f"image limits must be positive, got {self}")


DEFAULT_LIMITS = ImageLimits()

# Pillow warns past its own pixel limit, and raises past twice that, naming its limit. Ours,
# checked from the header, is the one a message names: its warning would only add a second one
# to the logs, and its error is reworded below.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
_PILLOW_PIXELS = re.compile(r"Image size \((\d+) pixels\)")

# Pillow's advice for `reducing_gap`: from 3.0 on, a reduce-then-resize is "indistinguishable
# from fair resampling in most cases".
REDUCING_GAP = 3.0
# Modes `Image.reduce` takes as they are; others are converted first (`_reducible`).
_REDUCIBLE_MODES = frozenset({"L", "LA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"})
_ORIENTATION = 0x0112  # EXIF tag
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # orientations that turn the image a quarter


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


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS, fit: tuple[int, int] | None = None) -> Image.Image:
    """A fully loaded RGB image: first frame, EXIF orientation applied, alpha composited onto
    white. `fit`: the (height, width) it will be resized to next; an image far larger comes
    shrunk to near it (`shrink_factors`)."""
    check_byte_size(len(data), limits)
    with _pillow_errors(data, limits):
        image = _opened(data, limits, fit)
        with budget_of(limits.budget_bytes).reserve(working_bytes(image)), closing(image):  # frees its buffer
            image.load()  # the first frame of an animation
            return _upright_rgb(image, fit)


def shrink_factors(size: tuple[int, int], fit: tuple[int, int]) -> tuple[int, int]:
    """Whole factors (x, y) that take an image of `size` (width, height) to no less than
    `REDUCING_GAP` times `fit` (height, width); (1, 1) for an image not that large. Pillow's
    own rule for `resize(..., reducing_gap=)`."""
    (width, height), (fit_height, fit_width) = size, fit
    return max(1, int(width / fit_width / REDUCING_GAP)), max(1, int(height / fit_height / REDUCING_GAP))


def working_bytes(image: Image.Image) -> int:
    """Bytes a decode of `image` (opened, not loaded) holds at its peak when it shrinks it:
    Pillow's buffer (4 bytes a pixel in every mode wider than 8 bits), the full-size copies
    made before the reduce (`_reducible`: float64 arrays for deep gray (`rgb.deep_gray_to_l`),
    RGBA for a transparency key and its premultiplied copy for any alpha, RGB for other modes)
    and the reduced image (at most a quarter of the pixels, 4 bytes each)."""
    width, height = image.size
    stored = 1 if image.mode in ("1", "L", "P") else 4
    if is_deep_gray(image):
        copies = 3 * 8
    elif has_alpha(image):
        copies = (0 if image.mode in ("LA", "RGBA") else 4) + 4
    else:
        copies = 0 if image.mode in _REDUCIBLE_MODES else 4
    return width * height * (stored + copies + 1)


def _opened(data: bytes, limits: ImageLimits, fit: tuple[int, int] | None) -> Image.Image:
    """The image with its header read and checked (nothing decoded yet); a JPEG far larger than
    `fit` set to decode at 1/2, 1/4 or 1/8 scale."""
    image = Image.open(io.BytesIO(data))
    try:
        _check_pixels(image.size, limits)
        if fit is not None and image.format == "JPEG":
            side = max(fit)  # either way up: its EXIF orientation is read once it is loaded
            request = (int(side * REDUCING_GAP), int(side * REDUCING_GAP))
            if min(shrink_factors(image.size, (side, side))) >= 2:
                image.draft(None, request)
    except BaseException:
        image.close()
        raise
    return image


def _upright_rgb(image: Image.Image, fit: tuple[int, int] | None) -> Image.Image:
    """A new RGB image from the loaded `image`, upright, shrunk first when `fit` asks it."""
    factors = (1, 1) if fit is None else shrink_factors(image.size, _as_stored(fit, image))
    if factors == (1, 1):
        ImageOps.exif_transpose(image, in_place=True)
        return to_rgb(image)
    small = _reducible(image).reduce(factors)  # a new image: turned and converted in place
    ImageOps.exif_transpose(small, in_place=True)
    return small if small.mode == "RGB" else to_rgb(small)  # RGB here has no transparency key


def _as_stored(fit: tuple[int, int], image: Image.Image) -> tuple[int, int]:
    """`fit` (height, width) as the pixels lie in the file, before EXIF turns them upright."""
    turned = image.getexif().get(_ORIENTATION) in _SWAPS_AXES
    return (fit[1], fit[0]) if turned else fit


def _reducible(image: Image.Image) -> Image.Image:
    """`image` in a mode `Image.reduce` averages correctly; transparency as an alpha band."""
    if is_deep_gray(image):
        return deep_gray_to_l(image)
    if has_alpha(image):
        return image if image.mode in ("LA", "RGBA") else image.convert("RGBA")
    return image if image.mode in _REDUCIBLE_MODES else image.convert("RGB")


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
