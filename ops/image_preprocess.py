"""PIL images -> pixel values, bit-for-bit what transformers' PIL image processor gives.

`Gemma3ImageProcessorPil` (what AutoProcessor builds without torchvision) does, per image:
to numpy, channels first, back to PIL, `resize((W, H), resample)` (no reducing_gap), to numpy,
`uint8 -> float64 * rescale -> float32`, then `(x - mean) / std` in float32. Every step after the
resize maps one uint8 value of one channel to one float32, so we resize once and read the result
through a [3, 256] lookup table built with those same numpy operations: the same bits, ~3x faster.

The two steps are also offered apart: `resized_images` (uint8, on the host) and `apply_lut`
(torch, on any device), so an engine can upload a quarter of the bytes and look values up there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from wicore.errors import ConfigError
from wicore.ops.rgb import to_rgb

if TYPE_CHECKING:
    import torch

# do_* flags whose work we reproduce; any other one that is on is a setting we do not support.
_HANDLED_FLAGS = frozenset({"do_resize", "do_rescale", "do_normalize", "do_convert_rgb"})


@dataclass(frozen=True)
class PreprocessSpec:
    size: tuple[int, int]  # (height, width) of every output image
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: Image.Resampling = Image.Resampling.BILINEAR

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _positive_pair(self.size))
        object.__setattr__(self, "mean", _three_floats(self.mean, "mean"))
        object.__setattr__(self, "std", _three_floats(self.std, "std"))
        object.__setattr__(self, "resample", _resampling(self.resample))
        if 0.0 in self.std:
            raise ConfigError(f"image std must not be zero, got {self.std}")

    @classmethod
    def from_hf(cls, image_processor: Any) -> PreprocessSpec:
        """Read an HF image processor's settings; refuse any we would not reproduce exactly."""
        p = image_processor
        _refuse_unsupported_flags(p)
        return cls(
            size=_fixed_size(p.size),
            # do_rescale / do_normalize off give the same bits as scale 1 / mean 0, std 1.
            rescale=float(p.rescale_factor) if p.do_rescale else 1.0,
            mean=_three_floats(p.image_mean, "image_mean") if p.do_normalize else (0.0, 0.0, 0.0),
            std=_three_floats(p.image_std, "image_std") if p.do_normalize else (1.0, 1.0, 1.0),
            resample=_hf_resample(getattr(p, "resample", None)),
        )

    @cached_property
    def lut(self) -> np.ndarray:
        """[3, 256] float32: channel c, uint8 value v -> its pixel value, by HF's own arithmetic.
        Computing it twice from two threads is harmless: both get the same table."""
        rescaled = (np.arange(256, dtype=np.uint8).astype(np.float64) * self.rescale).astype(np.float32)
        mean = np.array(self.mean, dtype=np.float32)[:, None]
        std = np.array(self.std, dtype=np.float32)[:, None]
        return (rescaled[None, :] - mean) / std


def pixel_values(images: Sequence[Image.Image], spec: PreprocessSpec) -> np.ndarray:
    """float32 [N, 3, H, W]. Non-RGB images are converted as transformers does. Thread-safe."""
    resized = resized_images(images, spec)
    out = np.empty((len(resized), 3, *spec.size), dtype=np.float32)
    lut = spec.lut
    for n, image in enumerate(resized):  # one image at a time: `out[n, c]` is contiguous
        for c in range(3):
            # mode="clip" lets np.take write straight into `out`; uint8 indices are always in range.
            np.take(lut[c], image[:, :, c], out=out[n, c], mode="clip")
    return out


def resized_images(images: Sequence[Image.Image], spec: PreprocessSpec) -> np.ndarray:
    """uint8 [N, H, W, 3]: each image converted to RGB as transformers does, then resized.
    Thread-safe."""
    height, width = spec.size
    out = np.empty((len(images), height, width, 3), dtype=np.uint8)
    for n, image in enumerate(images):
        if image.mode != "RGB":
            image = to_rgb(image)
        out[n] = np.asarray(image.resize((width, height), resample=spec.resample))
    return out


def is_resized(images: Sequence[Any]) -> bool:
    """Whether `images` came resized already: numpy arrays (a caller's `resized_images` rows)."""
    return bool(images) and all(isinstance(image, np.ndarray) for image in images)


def stack_resized(images: Sequence[np.ndarray], spec: PreprocessSpec) -> np.ndarray:
    """uint8 [N, H, W, 3] from rows that `resized_images` made for `spec` elsewhere; one
    image is a view, not a copy. Raises ConfigError for a row of another shape or dtype."""
    shape = (*spec.size, 3)
    for image in images:
        if image.dtype != np.uint8 or image.shape != shape:
            raise ConfigError(f"a resized image must be uint8 {shape}, got {image.dtype} {image.shape}")
    return images[0][None] if len(images) == 1 else np.stack(images)


def apply_lut(resized: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> [N, 3, H, W] of lut's dtype, value v of channel c read as lut[c, v].
    With `spec.lut` ([3, 256] float32) these are `pixel_values`' bits; a table cast to another
    dtype gives those values cast. Runs on resized's device (lut must be there too) as one add
    and one gather, through int32 indices: half the memory of int64 ones."""
    import torch

    n, height, width, _ = resized.shape
    device = resized.device
    index = torch.empty((n, 3, height, width), dtype=torch.int32, device=device)
    channel_starts = torch.arange(0, 3 * 256, 256, dtype=torch.int32, device=device).view(3, 1, 1)
    torch.add(resized.permute(0, 3, 1, 2), channel_starts, out=index)  # c * 256 + v, channels first
    return lut.flatten().index_select(0, index.flatten()).view(n, 3, height, width)


def _refuse_unsupported_flags(p: Any) -> None:
    """A step we do not reproduce (pan-and-scan, center crop, pad, ...) must not be dropped silently."""
    for name in sorted(n for n in dir(p) if n.startswith("do_") and n not in _HANDLED_FLAGS):
        if getattr(p, name, None):
            raise ConfigError(f"image processor setting {name}=True is not supported by wicore's preprocessing")
    if not p.do_resize:
        raise ConfigError("image processor has do_resize off: images of different sizes cannot be batched")


def _fixed_size(size: Any) -> tuple[int, int]:
    """HF's size (SizeDict or dict) -> (height, width); only a fixed height and width is supported."""
    fields = {k: v for k, v in dict(size).items() if v is not None}
    if set(fields) != {"height", "width"}:
        raise ConfigError(f"image processor size must be exactly height and width, got {fields}")
    return fields["height"], fields["width"]


def _positive_pair(size: Sequence[int]) -> tuple[int, int]:
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ConfigError(f"image size must be two positive ints (height, width), got {size!r}")
    return int(size[0]), int(size[1])


def _three_floats(value: float | Sequence[float], name: str) -> tuple[float, float, float]:
    """HF allows one number for all channels."""
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ConfigError(f"image {name} needs 3 values (R, G, B), got {value!r}")
    return float(values[0]), float(values[1]), float(values[2])


def _hf_resample(value: Any) -> int:
    """HF resizes with BILINEAR when unset. (NEAREST is 0: test for None, not falsiness.)"""
    return Image.Resampling.BILINEAR if value is None else value


def _resampling(value: int) -> Image.Resampling:
    try:
        return Image.Resampling(int(value))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"unknown PIL resampling filter {value!r}") from error
