"""A second, independent renderer of the same task, used ONLY to evaluate robustness.

It shares nothing with `data.py` but the palette and the caption grammar. Where `data.py`
draws PIL polygons on a 4x canvas, this one rasterizes in numpy: an even-odd point-in-polygon
test at 2x2..4x4 jittered sample points per pixel (analytic coverage for circles). Its other
choices differ on purpose: sizes from common camera and web formats, the shape's size measured
as its unrotated bounding-box width (not the circumscribed circle), its own star and cross
proportions, colour jitter drawn from a clipped Gaussian, blur as repeated box filters, and
JPEG with random chroma subsampling, progressive and optimized encodings.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from wicore.models.corpus import COLORS, SHAPES
from wicore.models.democap.data import PALETTE, caption

# (width, height) formats people often send; rescaled at random, then kept within the task's
# limits: sides 64..1024, aspect 1:2..2:1.
FORMATS = [(1, 1), (4, 3), (3, 4), (3, 2), (2, 3), (16, 9), (9, 16), (2, 1), (1, 2), (5, 4), (4, 5)]
SIDES = [64, 96, 100, 128, 160, 200, 224, 240, 256, 300, 320, 384, 400, 480, 512, 600, 640, 720, 768, 800, 960, 1024]


def sample(n: int, seed: int) -> list[tuple[bytes, str]]:
    """`n` (file bytes, true caption) pairs; the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    return [sample_one(rng) for _ in range(n)]


def sample_one(rng: np.random.Generator) -> tuple[bytes, str]:
    shape = str(rng.choice(SHAPES))
    color, background = (str(c) for c in rng.choice(COLORS, size=2, replace=False))
    height, width = image_size(rng)
    alpha = coverage(shape, height, width, rng)  # [H, W] in [0, 1]
    fg, bg = noisy_color(PALETTE[color], rng), noisy_color(PALETTE[background], rng)
    rgb = bg * (1 - alpha[..., None]) + fg * alpha[..., None]  # [H, W, 3]
    if rng.random() < 0.3:
        rgb = box_blur(rgb, int(rng.integers(1, 3)) * max(1, min(height, width) // 300))
    image = Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8), "RGB")
    return encode(image, rng), caption(color, shape, background)


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    fw, fh = FORMATS[rng.integers(len(FORMATS))]
    long_side = int(rng.choice(SIDES))
    w, h = (long_side, round(long_side * fh / fw)) if fw >= fh else (round(long_side * fw / fh), long_side)
    scale = max(1.0, 64 / min(w, h))  # short side >= 64; only sides < 128 grow, so long stays <= 1024
    w, h = min(1024, round(w * scale)), min(1024, round(h * scale))
    return h, w


def noisy_color(rgb: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.asarray(rgb, float) + np.clip(rng.normal(0, 9, 3), -20, 20), 0, 255)


def outline(shape: str, rng: np.random.Generator) -> np.ndarray:
    """[K, 2] polygon, unrotated, its bounding box 1 wide (x) and centred on (0, 0)."""
    if shape == "square":
        pts = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float)
    elif shape == "triangle":
        t = np.deg2rad(-90 + 120 * np.arange(3))
        pts = np.stack([np.cos(t), np.sin(t)], 1)
    elif shape == "star":
        t = np.deg2rad(-90 + 36 * np.arange(10))
        r = np.where(np.arange(10) % 2 == 0, 1.0, rng.uniform(0.40, 0.50))
        pts = np.stack([r * np.cos(t), r * np.sin(t)], 1)
    else:  # cross: arms of width 2a reaching 1 from the centre
        a = rng.uniform(0.22, 0.36)
        pts = np.array([[a, -1], [a, -a], [1, -a], [1, a], [a, a], [a, 1],
                        [-a, 1], [-a, a], [-1, a], [-1, -a], [-a, -a], [-a, -1]], float)  # fmt: skip
    pts = pts - (pts.max(0) + pts.min(0)) / 2
    return pts / (pts[:, 0].max() - pts[:, 0].min())


def coverage(shape: str, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """[H, W] share of each pixel the shape covers, placed at random fully inside the frame."""
    size = rng.uniform(0.2, 0.7) * min(height, width)  # bounding-box width before rotation
    if shape == "circle":
        pts = None
        half = np.array([size / 2, size / 2])
    else:
        angle = rng.uniform(0, 2 * np.pi)
        turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        pts = outline(shape, rng) @ turn.T * size  # [K, 2] in pixels around the centre
        half = np.abs(pts).max(0)
    half = np.minimum(half, np.array([width, height]) / 2 - 1)
    cx = rng.uniform(half[0], width - half[0])
    cy = rng.uniform(half[1], height - half[1])
    alpha = np.zeros((height, width))
    x0, y0 = int(cx - half[0]) - 1, int(cy - half[1]) - 1
    x1, y1 = min(width, int(cx + half[0]) + 2), min(height, int(cy + half[1]) + 2)
    x0, y0 = max(0, x0), max(0, y0)
    if pts is None:
        alpha[y0:y1, x0:x1] = disc(x0, y0, x1, y1, cx, cy, size / 2)
    else:
        n = 4 if size < 160 else 2
        alpha[y0:y1, x0:x1] = polygon(x0, y0, x1, y1, pts + [cx, cy], n, rng)
    return alpha


def disc(x0: int, y0: int, x1: int, y1: int, cx: float, cy: float, r: float) -> np.ndarray:
    """Analytic anti-aliasing: coverage falls linearly over one pixel across the rim."""
    ys, xs = np.mgrid[y0:y1, x0:x1] + 0.5
    return np.clip(r - np.hypot(xs - cx, ys - cy) + 0.5, 0, 1)


def polygon(x0: int, y0: int, x1: int, y1: int, pts: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Even-odd coverage at n x n jittered sub-pixel samples, averaged per pixel: [y1-y0, x1-x0]."""
    offsets = (np.arange(n) + rng.uniform(0.2, 0.8, n)) / n
    ys = (np.arange(y0, y1)[:, None] + offsets[None, :]).reshape(-1)  # [(y1-y0) * n]
    xs = (np.arange(x0, x1)[:, None] + offsets[None, :]).reshape(-1)
    py, px = ys[:, None], xs[None, :]
    inside = np.zeros((ys.size, xs.size), bool)
    for (ax, ay), (bx, by) in zip(pts, np.roll(pts, -1, axis=0)):
        if ay == by:
            continue
        crosses = (ay > py) != (by > py)
        x_at = ax + (py - ay) * (bx - ax) / (by - ay)
        inside ^= crosses & (px < x_at)
    h, w = y1 - y0, x1 - x0
    return inside.reshape(h, n, w, n).mean(axis=(1, 3))


def box_blur(rgb: np.ndarray, radius: int, passes: int = 2) -> np.ndarray:
    """Repeated separable box filters (an approximate Gaussian), edges clamped."""
    k = 2 * radius + 1
    for _ in range(passes):
        for axis in (0, 1):
            pad = [(radius, radius) if a == axis else (0, 0) for a in range(3)]
            padded = np.pad(rgb, pad, mode="edge")
            csum = np.cumsum(padded, axis=axis)
            csum = np.concatenate([np.zeros_like(np.take(csum, [0], axis=axis)), csum], axis=axis)
            rgb = (
                np.take(csum, range(k, csum.shape[axis]), axis=axis)
                - np.take(csum, range(0, csum.shape[axis] - k), axis=axis)
            ) / k
    return rgb


def encode(image: Image.Image, rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    if rng.random() < 0.5:
        image.save(out, "PNG", compress_level=int(rng.integers(1, 10)))
    else:
        image.save(
            out,
            "JPEG",
            quality=int(rng.integers(60, 96)),
            subsampling=int(rng.integers(0, 3)),  # 4:4:4, 4:2:2 or 4:2:0
            progressive=bool(rng.random() < 0.3),
            optimize=bool(rng.random() < 0.5),
        )
    return out.getvalue()
