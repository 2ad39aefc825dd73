"""Benchmark images: seeded, distinct, never blank, of mixed sizes and formats, written as files
the way users hand them over."""

from __future__ import annotations

import io
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def render(seed: int) -> tuple[bytes, str]:
    """Smooth random content (a coarse random grid upsampled) plus grain: compresses like a
    photo, unlike pure noise. Sizes 256-1280 px a side, aspect 1:2 to 2:1, JPEG or PNG."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(256, 1281))
    height = int(np.clip(width * rng.uniform(0.5, 2.0), 256, 1280))
    coarse = rng.integers(0, 256, (int(rng.integers(4, 24)), int(rng.integers(4, 24)), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    grain = rng.integers(-12, 13, (height, width, 3))
    image = Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + grain, 1, 255).astype(np.uint8))
    buffer = io.BytesIO()
    if seed % 4 == 0:
        image.save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue(), "png"
    image.save(buffer, format="JPEG", quality=int(rng.integers(75, 95)))
    return buffer.getvalue(), "jpg"


def _write(args: tuple[Path, int]) -> Path:
    folder, seed = args
    data, ext = render(seed)
    path = folder / f"bench-{seed:06d}.{ext}"
    path.write_bytes(data)
    return path


def make_images(folder: Path, count: int, seed: int = 0, processes: int = 8) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(processes) as pool:
        return list(pool.map(_write, [(folder, seed + i) for i in range(count)], chunksize=16))
