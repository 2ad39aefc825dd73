"""Writes the example images of the README's first command, drawn by the demo captioner's own
generator (`wicore.models.democap.data`, seed 123: sizes, aspects, PNG/JPEG, rotations and
jitter as in the task): the first image of each shape in the seed's stream, then the next one.
Each file is named after its true caption.

python examples/make_images.py examples/images
"""

from __future__ import annotations

import sys
from pathlib import Path

from wicore.models.corpus import SHAPES
from wicore.models.democap import data

SEED, COUNT = 123, 6


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    stream = data.sample_specs(200, SEED)
    firsts = [next(s for s in stream if s.shape == shape) for shape in SHAPES]
    picked = firsts + [s for s in stream if s not in firsts][: COUNT - len(firsts)]
    for spec in picked:
        name = f"{spec.color}-{spec.shape}-on-{spec.background}.{'png' if spec.fmt == 'PNG' else 'jpg'}"
        (out / name).write_bytes(data.image_bytes(spec))
        print(out / name, spec.caption)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/images")
