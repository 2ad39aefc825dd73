"""Writes the example images of the README's first command (a shape on a plain background each).

python examples/make_images.py examples/images
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from PIL import Image, ImageDraw

EXAMPLES = [  # file, size, shape, colour, background
    ("red-circle.png", (320, 240), "circle", (220, 30, 30), (30, 60, 220)),
    ("yellow-star.jpg", (400, 400), "star", (240, 220, 40), (140, 50, 190)),
    ("green-square.png", (256, 384), "square", (30, 170, 60), (245, 245, 245)),
    ("white-triangle.jpg", (512, 300), "triangle", (245, 245, 245), (15, 15, 15)),
    ("orange-cross.png", (300, 300), "cross", (245, 140, 20), (30, 60, 220)),
    ("blue-circle.jpg", (640, 480), "circle", (30, 60, 220), (240, 220, 40)),
]


def polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "star":
        return [
            (cx + (r if i % 2 == 0 else r * 0.4) * math.cos(-math.pi / 2 + i * math.pi / 5),
             cy + (r if i % 2 == 0 else r * 0.4) * math.sin(-math.pi / 2 + i * math.pi / 5))
            for i in range(10)
        ]  # fmt: skip
    if shape == "cross":
        t = r / 3
        return [(cx - t, cy - r), (cx + t, cy - r), (cx + t, cy - t), (cx + r, cy - t), (cx + r, cy + t),
                (cx + t, cy + t), (cx + t, cy + r), (cx - t, cy + r), (cx - t, cy + t), (cx - r, cy + t),
                (cx - r, cy - t), (cx - t, cy - t)]  # fmt: skip
    raise ValueError(shape)


def draw(size, shape, colour, background) -> Image.Image:
    image = Image.new("RGB", size, background)
    pen = ImageDraw.Draw(image)
    cx, cy, r = size[0] / 2, size[1] / 2, min(size) * 0.3
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        pen.polygon(polygon(shape, cx, cy, r), fill=colour)
    return image


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/images")
    out.mkdir(parents=True, exist_ok=True)
    for name, size, shape, colour, background in EXAMPLES:
        draw(size, shape, colour, background).save(out / name, quality=90)
