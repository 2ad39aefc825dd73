"""What the caption benchmark sends a prompt, by variant (`--variant`): one image then the prompt
(the default), two images then the prompt (two of the bench's images, each in one prompt), or text
only (a prompt of its own each, so that no two jobs are one by their content). `--images N` draws
N images: N prompts of one, N / 2 of two, or N text prompts. The same prompts go
to the product and to the HF peer; throughput is prompts/s, images/s (prompts/s x images per
prompt) and output tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VARIANTS = {"one-image": 1, "two-images": 2, "text-only": 0}  # variant -> images per prompt
TEXT_PROMPT = "Write a long story about house number {index}."


@dataclass(frozen=True)
class BenchPrompt:
    key: str  # what the parity report pairs the two sides' tokens by
    images: tuple[Path, ...]
    text: str


def images_per_prompt(variant: str) -> int:
    from wicore.errors import ConfigError

    if variant not in VARIANTS:
        raise ConfigError(f"--variant {variant}: choose one of {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def bench_prompts(variant: str, paths: list[Path], prompt: str) -> list[BenchPrompt]:
    """The prompts made of `paths` (the images drawn for the run): each image in one prompt
    (two-images: len(paths) // 2 prompts, no image in two, so no vision cache hit), or, text
    only, one text prompt per path."""
    per = images_per_prompt(variant)
    if per == 0:
        return [BenchPrompt(f"text-{i}", (), TEXT_PROMPT.format(index=i)) for i in range(len(paths))]
    groups = [tuple(paths[i : i + per]) for i in range(0, len(paths) - per + 1, per)]
    return [BenchPrompt(str(group[0]), group, prompt) for group in groups]


def submission(item: BenchPrompt, params):
    from wicore.producer import Submission

    if not item.images:
        return Submission(prompt=item.text, params=params, name=item.key)
    return Submission(item.images[0], item.text, params=params, images=item.images[1:])


def peer_chat(item: BenchPrompt) -> list[dict]:
    """The conversation HF's processor lays out for `item`: its images, then its text."""
    return [
        {"role": "user", "content": [*({"type": "image"} for _ in item.images), {"type": "text", "text": item.text}]}
    ]
