"""Time wicore's pixel_values against transformers' Gemma3ImageProcessorPil on the same images.

    python bench/preprocess_speed.py --images 32 --size 896

Prints seconds per batch (best of --repeats) and whether the outputs are bit-identical.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from wicore.ops.image_preprocess import PreprocessSpec, pixel_values


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--size", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    # ~1000x700, varied a little so no two images share a shape.
    images = [Image.fromarray(rng.integers(0, 256, (700 + i, 1000 - i, 3), dtype=np.uint8)) for i in range(args.images)]
    processor = Gemma3ImageProcessorPil(
        size={"height": args.size, "width": args.size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    spec = PreprocessSpec.from_hf(processor)

    theirs = processor(images, return_tensors="np")["pixel_values"]
    ours = pixel_values(images, spec)
    print(
        f"bit-identical: {np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))}, "
        f"max abs diff {np.abs(ours - theirs).max()}"
    )

    hf_s = best_of(args.repeats, lambda: processor(images, return_tensors="np"))
    ours_s = best_of(args.repeats, lambda: pixel_values(images, spec))
    chunks = [images[i :: args.threads] for i in range(args.threads)]
    with ThreadPoolExecutor(args.threads) as pool:
        threaded_s = best_of(args.repeats, lambda: list(pool.map(lambda c: pixel_values(c, spec), chunks)))
    n = args.images
    print(f"HF Gemma3ImageProcessorPil: {hf_s:.3f} s ({hf_s / n * 1000:.1f} ms/image)")
    print(f"wicore pixel_values:        {ours_s:.3f} s ({ours_s / n * 1000:.1f} ms/image), {hf_s / ours_s:.2f}x")
    print(f"wicore, {args.threads} threads:         {threaded_s:.3f} s ({threaded_s / n * 1000:.1f} ms/image)")


if __name__ == "__main__":
    main()
