"""The host-side inputs of a packed prefill: each sequence's uncached suffix.

Sequence b prefills positions [P_b, L_b) of its prompt (P_b = `seq.cache.prefix_len`, 0 without a
cache hit): their token ids, positions, cache slots and the rows of their image soft tokens.
Attention needs every position's image run (`image_groups`, [B, max L], absolute positions) and,
when some P_b > 0, the cache slots of the prefix positions, to gather their K/V (`PrefixInputs`).

A short suffix (a follow-up question over a cached image, its image's last soft tokens when
the cached prefix splits it, a short text prompt) needs none of that: its tokens store their
K/V and attend over their pages (`pages_only`), each to its own end: position + 1, or its
image's end. Its inputs are a few int64 columns per token (`paged_columns`), the shape a CUDA
graph bucket takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wicore.engines.fast.sequence import Sequence
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.ops.attention import pack_layout
from wicore.ops.attention.prefix_prefill import PrefixBatch, prefix_layout
from wicore.ops.transfer import upload


@dataclass
class PrefixInputs:
    batch: PrefixBatch
    slots: torch.Tensor  # [G, sum P] int64 cache slot of every prefix position, batch order


def prefill_inputs(seqs: list[Sequence], layout: KVLayout, tokens_per_image: int, vocab: int, device) -> dict:
    """Keyword arguments of `ModelRunner.prefill_logits` for `seqs`."""
    prefix = [s.cache.prefix_len for s in seqs]
    lengths = [s.prompt_len - p for s, p in zip(seqs, prefix, strict=True)]  # suffix lengths
    offsets = np.cumsum([0] + lengths[:-1])
    ids = np.concatenate([np.asarray(s.prompt.ids[p:], dtype=np.int64) for s, p in zip(seqs, prefix, strict=True)])
    ids[ids >= vocab] = 0  # an out-of-vocabulary image token id embeds as pad (as HF)
    groups = np.full((len(seqs), max(s.prompt_len for s in seqs)), -1, dtype=np.int64)  # image run
    image_rows = []
    for b, (seq, offset) in enumerate(zip(seqs, offsets, strict=True)):
        for i, start in enumerate(seq.prompt.image_starts):
            groups[b, start : start + tokens_per_image] = i
        image_rows += suffix_image_rows(seq, offset, tokens_per_image)
    slots = [
        layout.prefill_slots(s.kv.table, s.prompt_len, p, s.cache.shared_len) for s, p in zip(seqs, prefix, strict=True)
    ]

    def dev(array: np.ndarray) -> torch.Tensor:
        return upload(array, device)

    inputs = {
        "ids": dev(ids),
        "positions": dev(np.concatenate([np.arange(p, s.prompt_len) for s, p in zip(seqs, prefix, strict=True)])),
        "slots": dev(np.concatenate(slots, axis=1)),
        "image_rows": dev(np.concatenate(image_rows) if image_rows else np.zeros(0, dtype=np.int64)),
        "image_groups": dev(groups),
        "last": dev(offsets + np.asarray(lengths) - 1),
        "layout": pack_layout(lengths, device),
    }
    if any(prefix):
        batch = prefix_layout(prefix, lengths, device)
        prefix_slots = np.concatenate(
            [layout.prefix_slots(s.kv.table, p) for s, p in zip(seqs, prefix, strict=True)], 1
        )
        inputs["prefix"] = PrefixInputs(batch, dev(prefix_slots))
        inputs["layout"] = batch.queries
    return inputs


def suffix_image_rows(seq: Sequence, offset: int, tokens_per_image: int) -> list[np.ndarray]:
    """Packed rows of the suffix's image soft tokens (the suffix starts at row `offset`), one
    array per image from `first_image` on: its tokens from the prefix's end on (all of them,
    but for an image the cached prefix splits). In `suffix_image_embeds`' order."""
    p = seq.cache.prefix_len
    rows = []
    for start in seq.prompt.image_starts[seq.cache.first_image :]:
        first = max(start, p)
        rows.append(offset + first - p + np.arange(start + tokens_per_image - first))
    return rows


def suffix_image_embeds(seqs: list[Sequence]) -> list[torch.Tensor]:
    """[image tokens in the suffix, hidden] of each sequence: its images from `first_image` on,
    less the soft tokens of a split first one that lie in the cached prefix."""
    out = []
    for s in seqs:
        if s.images_in_suffix:
            first = s.cache.first_image
            cached = max(0, s.cache.prefix_len - s.prompt.image_starts[first])
            out.append(s.vision.embeds[first:].flatten(0, 1)[cached:])
    return out


# Rows of `paged_columns`: ids, positions, table rows, visible ends, tile first token, tile token
# count, then one row of cache slots per layer group. Graph buckets pad with `paged_fills`.
IDS, POSITIONS, ROWS, ENDS, TILE_FIRST, TILE_COUNT, SLOTS = range(7)


def paged_fills(null_row: int, groups: int) -> list[int]:
    """Padding tokens: id 0 at position 0 of the null row, in no tile, written to the null page."""
    return [0, 0, null_row, 1, 0, 0] + [0] * groups


def pages_only(seq: Sequence, layout: KVLayout, max_suffix: int) -> bool:
    """Whether the prefill attends over the pages alone: a suffix of at most `max_suffix`
    tokens (longer ones run better through the dense kernel's larger tiles) of a sequence that
    never wraps a sliding ring (every position it attends to stays in its pages)."""
    return seq.prompt_len - seq.cache.prefix_len <= max_suffix and not layout.wraps(seq.prompt_len)


def paged_columns(
    seqs: list[Sequence], layout: KVLayout, tile_tokens: int, vocab: int, tokens_per_image: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(columns [SLOTS + groups, N] int64, last [B], image rows [I]): the suffix tokens of `seqs`
    packed, the index of each sequence's last token, the rows of its image soft tokens. Tiles:
    `tile_tokens` consecutive tokens of one sequence (the attention kernel reads their keys
    once); tile t's entries sit in column t."""
    lengths = [s.prompt_len - s.cache.prefix_len for s in seqs]
    columns = np.zeros((SLOTS + len(layout.groups), sum(lengths)), dtype=np.int64)
    image_rows = []
    offset, tile = 0, 0
    for seq, length in zip(seqs, lengths, strict=True):
        p, end = seq.cache.prefix_len, offset + length
        columns[IDS, offset:end] = seq.prompt.ids[p:]
        columns[POSITIONS, offset:end] = np.arange(p, seq.prompt_len)
        columns[ROWS, offset:end] = seq.kv.row
        columns[ENDS, offset:end] = columns[POSITIONS, offset:end] + 1
        for rows in suffix_image_rows(seq, offset, tokens_per_image):  # an image's tokens see it all
            columns[ENDS, rows] = columns[POSITIONS, rows[-1]] + 1
            image_rows.append(rows)
        columns[SLOTS:, offset:end] = layout.prefill_slots(seq.kv.table, seq.prompt_len, p, seq.cache.shared_len)
        starts = np.arange(offset, end, tile_tokens)
        columns[TILE_FIRST, tile : tile + len(starts)] = starts
        columns[TILE_COUNT, tile : tile + len(starts)] = np.minimum(tile_tokens, end - starts)
        offset, tile = end, tile + len(starts)
    columns[IDS][columns[IDS] >= vocab] = 0  # as `prefill_inputs`
    image_rows = np.concatenate(image_rows) if image_rows else np.zeros(0, dtype=np.int64)
    return columns, np.cumsum(lengths) - 1, image_rows
