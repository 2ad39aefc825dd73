"""Any Pillow mode to 8-bit RGB, by the same rule as transformers' image processors.

transformers (`image_transforms.convert_to_rgb`, 5.x) composites any image with an alpha band or a
`transparency` key onto opaque white and converts everything else with Pillow's `convert("RGB")`.
We do the same, so an image we convert gives the HF processor exactly the pixels the original
would have. The one deliberate difference: 16- and 32-bit grayscale (modes I;16*, I, F), which
Pillow clips at 255 (a 16-bit photo comes out nearly white); we scale those to 0..255 first.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

_WHITE = (255, 255, 255, 255)


def to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image; transparency composited onto white (as transformers does)."""
    if is_deep_gray(image):
        image = deep_gray_to_l(image)
    if has_alpha(image):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _WHITE)
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def has_alpha(image: Image.Image) -> bool:
    """transformers' own test: an "A" band (LA, PA, RGBA) or a transparency key (P, L, RGB)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def is_deep_gray(image: Image.Image) -> bool:
    return image.mode in ("I", "F") or image.mode.startswith("I;16")


def deep_gray_to_l(image: Image.Image) -> Image.Image:
    """16/32-bit gray -> 8-bit L. Any transparency key is dropped (rare in such files)."""
    values = np.nan_to_num(np.asarray(image, dtype=np.float64))  # [H, W]
    if values.size and values.min() < 0:
        values -= values.min()  # signed data (32-bit TIFF) has no defined black: start it at 0
    top = float(values.max()) if values.size else 0.0
    scaled = values * _gray_scale(image.mode, top)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))  # uint8 [H, W] -> mode L


def _gray_scale(mode: str, top: float) -> float:
    """Factor onto 0..255: I;16 is 16-bit by definition; I and F are judged by their largest value."""
    if mode.startswith("I;16"):
        return 255.0 / 65535.0
    if mode == "F" and top <= 1.0:
        return 255.0  # float images in [0, 1]
    if top <= 255.0:
        return 1.0  # 8-bit values held in a wide mode: what Pillow's convert gives too
    if top <= 65535.0:
        return 255.0 / 65535.0  # 16-bit data in a 32-bit mode (older Pillow opened 16-bit PNGs as I)
    return 255.0 / top
