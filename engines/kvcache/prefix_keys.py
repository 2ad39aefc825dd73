"""Prefix-cache keys of a prompt, and the model id that salts them.

Keys are `wicore.engines.kvcache.block_hashes.block_hashes` of the prompt's full blocks: image soft
tokens are salted by the image's sha256 (`EngineRequest.image_hashes`, or a digest of the decoded
pixels when the caller gave none), the chain's root by a model id that changes whenever the KV
would: the checkpoint (config, sampled weight bytes), the KV dtype, block size and page layout.
Stable across processes and hosts (no Python `hash`, no paths, no times).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from wicore.engines.checkpoint import SEED_FILE
from wicore.engines.kvcache.block_hashes import BlockHash, ImageSpan, block_hashes
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.errors import JobInputError

LAYOUT_VERSION = 1  # bump when the meaning of a cached page changes
IMAGE_BLOCK_COST = 5.0  # recomputing a block with image tokens also needs the vision tower
SAMPLES_PER_FILE, SAMPLE_BYTES = 8, 256 * 1024
MODEL_FILES = ("config.json", SEED_FILE, "model.safetensors.index.json")


@dataclass(frozen=True)
class PromptKeys:
    keys: list[BlockHash]  # one per full block of the prompt
    costs: list[float]  # the eviction policy's cost of each block
    image_spans: tuple[tuple[int, int], ...]  # [start, end) of each image's soft tokens


@dataclass(frozen=True)
class PromptKeyer:
    """Keys of a request's prompt for one engine (its model id, block size, image tokens)."""

    model_id: str
    block_size: int
    tokens_per_image: int

    def __call__(self, request, prompt) -> PromptKeys:
        digests = image_digests(request.image_hashes, request.images)
        ids, starts = prompt.ids, prompt.image_starts
        return prompt_keys(ids, starts, digests, self.tokens_per_image, self.block_size, self.model_id)


def model_fingerprint(model_dir: str | Path, dtype: str, layout: KVLayout) -> str:
    """A hex id of everything the cached K/V depend on. Weights are sampled (sizes and
    SAMPLES_PER_FILE chunks of each safetensors file), not read whole."""
    root = Path(model_dir)
    groups = [list(g.layers) for g in layout.groups]
    h = hashlib.sha256(f"wicore-fast-kv-v{LAYOUT_VERSION}|{dtype}|{layout.block_size}|{groups}".encode())
    for name in MODEL_FILES:
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0" + _sampled_digest(path))
    return h.hexdigest()[:32]


def _sampled_digest(path: Path) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        for i in range(SAMPLES_PER_FILE):
            f.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES_PER_FILE - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def image_digests(image_hashes: list[str], images: list) -> list[str]:
    """The caller's sha256 of each image's bytes, or (none given) a sha256 of the decoded image."""
    if image_hashes:
        if len(image_hashes) != len(images):
            raise JobInputError(f"{len(image_hashes)} image hashes for {len(images)} images")
        return [h.lower() for h in image_hashes]
    return [_pixel_digest(image) for image in images]


def _pixel_digest(image) -> str:
    """A decoded PIL image's, or a resized uint8 array's (`EngineRequest.images`)."""
    try:
        kind = f"{image.dtype}|{image.shape}" if hasattr(image, "shape") else f"{image.mode}|{image.size}"
        h = hashlib.sha256(kind.encode())
        h.update(image.tobytes())
    except (AttributeError, ValueError, OSError) as error:
        raise JobInputError(f"cannot read an image to key the prefix cache: {error}") from error
    return h.hexdigest()


def prompt_keys(
    ids: list[int], image_starts: list[int], digests: list[str], tokens_per_image: int, block_size: int, model_id: str
) -> PromptKeys:
    spans = tuple((start, start + tokens_per_image) for start in image_starts)
    try:
        image_spans = [ImageSpan(s, e, d) for (s, e), d in zip(spans, digests, strict=True)]
    except ValueError as error:
        raise JobInputError(f"bad image hash: {error}") from error
    keys = block_hashes(ids, block_size, image_spans, model_id)
    costs = [1.0] * len(keys)
    for start, end in spans:  # blocks holding any of an image's soft tokens
        for i in range(start // block_size, min(len(keys), -(-end // block_size))):
            costs[i] = IMAGE_BLOCK_COST
    return PromptKeys(keys, costs, spans)


def usable_prefix(found: int, block_size: int, prompt_len: int, image_spans, split_images: bool = False) -> int:
    """Prompt tokens to take from `found` leading cached blocks: all of them, but at least the
    last token is recomputed (its logits start the generation), and never a prefix that ends
    inside an image's soft tokens (they attend to each other both ways, so a split image would
    still need its embeddings): such a match is cut back to the block where that image starts.
    With `split_images` it may end inside one (its cached K/V were computed with the whole
    image, the same one by its hash); its remaining soft tokens then need the embeddings."""
    prefix = min(found * block_size, prompt_len - 1)
    cut = not split_images
    while cut:
        cut = False
        for start, end in image_spans:
            if start < prefix < end:
                prefix = (start // block_size) * block_size
                cut = True
    return prefix


def blocks_of(prefix: int, block_size: int) -> int:
    """Cached blocks a prefix of `prefix` tokens reads."""
    return math.ceil(prefix / block_size)
