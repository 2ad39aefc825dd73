"""The demo captioner's task: one shape on a plain background, as users hand such images over.

`sample_specs(n, seed)` draws image descriptions (seeded, reproducible: Python's `random`
generator, whose sequence is stable across versions and platforms); `render(spec)` draws one
with PIL; `encode(spec, image)` writes the PNG or JPEG bytes a user would upload. Captions
follow one grammar: "{a|an} {color} {shape} on {a|an} {background} background".
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from functools import cache

from PIL import Image, ImageDraw, ImageFilter

from wicore.models.corpus import COLORS, SHAPES

# Nominal RGB of each color name; images jitter every channel by up to +-JITTER.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 40),
    "orange": (245, 140, 20),
    "purple": (140, 50, 190),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
JITTER = 20
MIN_SIDE, MAX_SIDE = 64, 1024
MIN_FRACTION, MAX_FRACTION = 0.20, 0.70  # shape diameter / short side
SUPERSAMPLE = 4  # anti-aliasing: the shape's mask is drawn at 4x and box-filtered down


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(color: str, shape: str, background: str) -> str:
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


@dataclass(frozen=True)
class Spec:
    """One image: what it shows and how it was made. Angles in degrees, center in pixels."""

    shape: str
    color: str
    background: str
    width: int
    height: int
    diameter: float  # of the shape's circumscribed circle, in pixels
    cx: float
    cy: float
    angle: float
    fg: tuple[int, int, int]  # jittered RGB
    bg: tuple[int, int, int]
    star_inner: float  # inner / outer radius of the star's points
    cross_arm: float  # half-width of a cross arm / its reach
    blur: float  # Gaussian radius in pixels; 0 = sharp
    fmt: str  # "PNG" | "JPEG"
    quality: int  # JPEG quality (ignored for PNG)

    @property
    def caption(self) -> str:
        return caption(self.color, self.shape, self.background)


def sample_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [sample_spec(rng) for _ in range(n)]


def sample_spec(rng: random.Random) -> Spec:
    shape = rng.choice(SHAPES)
    color, background = rng.sample(COLORS, 2)
    width, height = sample_size(rng)
    short = min(width, height)
    diameter = rng.uniform(MIN_FRACTION, MAX_FRACTION) * short
    radius = diameter / 2
    jpeg = rng.random() < 0.5
    return Spec(
        shape=shape,
        color=color,
        background=background,
        width=width,
        height=height,
        diameter=diameter,
        cx=rng.uniform(radius, width - radius),
        cy=rng.uniform(radius, height - radius),
        angle=rng.uniform(0.0, 360.0),
        fg=jittered(PALETTE[color], rng),
        bg=jittered(PALETTE[background], rng),
        star_inner=rng.uniform(0.36, 0.52),
        cross_arm=rng.uniform(0.25, 0.42),
        blur=rng.uniform(0.4, 1.6) * max(1.0, short / 256) if rng.random() < 0.3 else 0.0,
        fmt="JPEG" if jpeg else "PNG",
        quality=rng.randint(60, 95),
    )


def sample_size(rng: random.Random) -> tuple[int, int]:
    """Log-uniform area scale, aspect between 1:2 and 2:1, both sides in [64, 1024]."""
    while True:
        side = math.exp(rng.uniform(math.log(MIN_SIDE), math.log(MAX_SIDE)))
        aspect = math.exp(rng.uniform(-math.log(2), math.log(2)))  # width / height
        width, height = round(side * math.sqrt(aspect)), round(side / math.sqrt(aspect))
        if min(width, height) >= MIN_SIDE and max(width, height) <= MAX_SIDE:
            return width, height


def jittered(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in rgb)
    return r, g, b


@cache
def unit_outline(shape: str, star_inner: float = 0.4, cross_arm: float = 0.33) -> tuple[tuple[float, float], ...]:
    """Polygon vertices of `shape` around (0, 0), farthest vertex at distance 1, unrotated."""
    if shape == "square":
        return tuple(polar(1.0, 45 + 90 * k) for k in range(4))
    if shape == "triangle":
        return tuple(polar(1.0, 90 + 120 * k) for k in range(3))
    if shape == "star":
        return tuple(polar(1.0 if k % 2 == 0 else star_inner, 90 + 36 * k) for k in range(10))
    if shape == "cross":
        reach = 1 / math.hypot(1.0, cross_arm)  # arm tip corners land on the unit circle
        w = cross_arm * reach
        quarter = [(reach, -w), (reach, w), (w, w)]  # the right arm and the corner above it
        return tuple(rotate(p, 90 * k) for k in range(4) for p in quarter)
    raise ValueError(f"no outline for shape {shape!r}")


def polar(r: float, degrees: float) -> tuple[float, float]:
    t = math.radians(degrees)
    return r * math.cos(t), r * math.sin(t)


def rotate(p: tuple[float, float], degrees: float) -> tuple[float, float]:
    t = math.radians(degrees)
    return p[0] * math.cos(t) - p[1] * math.sin(t), p[0] * math.sin(t) + p[1] * math.cos(t)


def render(spec: Spec) -> Image.Image:
    """The RGB image `spec` describes (y grows downwards, so angles turn clockwise)."""
    image = Image.new("RGB", (spec.width, spec.height), spec.bg)
    mask, (left, top) = shape_mask(spec)
    image.paste(Image.new("RGB", mask.size, spec.fg), (left, top), mask)
    if spec.blur > 0:
        image = image.filter(ImageFilter.GaussianBlur(spec.blur))
    return image


def shape_mask(spec: Spec) -> tuple[Image.Image, tuple[int, int]]:
    """Anti-aliased coverage ("L") of the shape's bounding box, and the box's top-left corner."""
    radius = spec.diameter / 2
    left, top = math.floor(spec.cx - radius), math.floor(spec.cy - radius)
    size = math.ceil(spec.cx + radius) - left + 1, math.ceil(spec.cy + radius) - top + 1
    s = SUPERSAMPLE
    canvas = Image.new("L", (size[0] * s, size[1] * s), 0)
    draw = ImageDraw.Draw(canvas)
    ox, oy = (spec.cx - left) * s, (spec.cy - top) * s  # the center on the supersampled canvas
    if spec.shape == "circle":
        r = radius * s
        draw.ellipse((ox - r, oy - r, ox + r, oy + r), fill=255)
    else:
        outline = unit_outline(spec.shape, round(spec.star_inner, 3), round(spec.cross_arm, 3))
        points = [rotate(p, spec.angle) for p in outline]
        draw.polygon([(ox + x * radius * s, oy + y * radius * s) for x, y in points], fill=255)
    return canvas.reduce(s), (left, top)


def encode(spec: Spec, image: Image.Image) -> bytes:
    """The file a user would hand over: PNG, or JPEG at the spec's quality (PIL's 4:2:0)."""
    out = io.BytesIO()
    if spec.fmt == "JPEG":
        image.save(out, format="JPEG", quality=spec.quality)
    else:
        image.save(out, format="PNG")
    return out.getvalue()


def image_bytes(spec: Spec) -> bytes:
    return encode(spec, render(spec))


def decode(data: bytes) -> Image.Image:
    """As a user's image reaches the model: opened with PIL, converted to RGB."""
    return Image.open(io.BytesIO(data)).convert("RGB")
