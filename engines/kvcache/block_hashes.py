"""Prefix block hashes for a paged KV cache.

Block i of a sequence is keyed by sha256(parent hash, block i's encoding), so equal hashes mean
equal whole prefixes, not just equal blocks. The chain starts from a root salted by the model id
(KV from another model is never reused). Image placeholder tokens are all the same id, so every
block that holds part of an image also encodes that image's content hash (sha256 of its bytes)
and the offset into the image: the same prompt with a different image diverges from the first
image block on, and two jobs with the same image and prompt prefix share blocks.

Stable across processes and hosts: hashlib, fixed little-endian encoding, never Python `hash`.

Encoding of one block (all integers little-endian uint32):
    b"B" | n_tokens | token ids... | n_segments | (start, end, image_offset, sha256 digest)...
where a segment is the part of one image span that falls in the block, in block coordinates.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 32-byte sha256 digest
HASH_VERSION = b"wicore-kv-v1"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class ImageSpan:
    """Token positions [start, end) hold the placeholders of one image with this content hash."""

    start: int
    end: int
    sha256: str  # hex digest of the image's bytes

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"bad image span [{self.start}, {self.end})")
        if not _SHA256_HEX.match(self.sha256):
            raise ValueError(f"image hash must be 64 lowercase hex digits, got {self.sha256!r}")


SpanLike = ImageSpan | tuple[int, int, str]


def root_hash(model_id: str) -> BlockHash:
    """The parent of block 0: every chain is salted by the model id."""
    return hashlib.sha256(HASH_VERSION + b"\0" + model_id.encode()).digest()


@dataclass(frozen=True)
class BlockSegment:
    """The part of one image span that falls inside a block, in block coordinates."""

    start: int
    end: int
    sha256: str
    image_offset: int  # index of `start` inside the image's placeholder run


def hash_block(parent: BlockHash, token_ids: Sequence[int], segments: Sequence[BlockSegment] = ()) -> BlockHash:
    """One link of the chain. Blocks filled during decode hold no image: `segments` stays empty."""
    h = hashlib.sha256(parent)
    h.update(b"B" + _pack_uints([len(token_ids), *token_ids]))
    h.update(_pack_uints([len(segments)]))
    for seg in segments:
        h.update(_pack_uints([seg.start, seg.end, seg.image_offset]) + bytes.fromhex(seg.sha256))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    image_spans: Sequence[SpanLike] = (),
    model_id: str = "",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block gets none).

    `parent` continues an existing chain (e.g. blocks filled during decode): pass the last full
    block's hash, and token ids / spans relative to the first new block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if hasattr(token_ids, "tolist"):  # a tensor or an array
        token_ids = token_ids.tolist()
    # The chain of `hash_block` (same bytes), with the ids packed once for the whole prompt: the
    # engine keys every request as it arrives (a 4B VQA prompt: ~19 blocks, ~17 of them image).
    packed, head = _pack_uints(token_ids), b"B" + _pack_uints([block_size])
    spans = _checked_spans(image_spans, len(token_ids))
    parent = root_hash(model_id) if parent is None else parent
    digests = [bytes.fromhex(span.sha256) for span in spans]
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parts = [parent, head, packed[4 * start : 4 * end], b""]
        for span, digest in zip(spans, digests, strict=True):  # the block's image segments
            lo, hi = max(span.start, start), min(span.end, end)
            if lo < hi:
                parts += [struct.pack("<3I", lo - start, hi - start, lo - span.start), digest]
        parts[3] = struct.pack("<I", (len(parts) - 4) // 2)
        parent = hashlib.sha256(b"".join(parts)).digest()
        hashes.append(parent)
    return hashes


def _checked_spans(image_spans: Sequence[SpanLike], n_tokens: int) -> list[ImageSpan]:
    spans = sorted((s if isinstance(s, ImageSpan) else ImageSpan(*s) for s in image_spans), key=lambda s: s.start)
    for prev, span in zip(spans, spans[1:], strict=False):
        if span.start < prev.end:
            raise ValueError(f"image spans overlap: {prev} and {span}")
    if spans and spans[-1].end > n_tokens:
        raise ValueError(f"image span {spans[-1]} runs past the {n_tokens} tokens")
    return spans


def _pack_uints(values: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as e:
        raise ValueError(f"token ids and positions must be integers in [0, {_UINT32_MAX}]") from e
