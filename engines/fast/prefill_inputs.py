"""The host-side inputs of a packed prefill: each sequence's uncached suffix.

Sequence b prefills positions [P_b, L_b) of its prompt (P_b = `seq.prefix_len`, 0 without a
cache hit): their token ids, positions, cache slots and the rows of their image soft tokens.
Attention needs every position's image run (`image_groups`, [B, max L], absolute positions) and,
when some P_b > 0, the cache slots of the prefix positions, to gather their K/V (`PrefixInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wicore.engines.fast.kv_cache import KVLayout
from wicore.engines.fast.sequence import Sequence
from wicore.ops.attention import pack_layout
from wicore.ops.prefix_attention import PrefixBatch, prefix_layout
from wicore.ops.transfer import upload


@dataclass
class PrefixInputs:
    batch: PrefixBatch
    slots: torch.Tensor  # [G, sum P] int64 cache slot of every prefix position, batch order


def prefill_inputs(seqs: list[Sequence], layout: KVLayout, tokens_per_image: int, vocab: int, device) -> dict:
    """Keyword arguments of `ModelRunner.prefill_logits` for `seqs`."""
    prefix = [s.prefix_len for s in seqs]
    lengths = [s.prompt_len - p for s, p in zip(seqs, prefix, strict=True)]  # suffix lengths
    offsets = np.cumsum([0] + lengths[:-1])
    ids = np.concatenate([np.asarray(s.prompt.ids[p:], dtype=np.int64) for s, p in zip(seqs, prefix, strict=True)])
    ids[ids >= vocab] = 0  # an out-of-vocabulary image token id embeds as pad (as HF)
    groups = np.full((len(seqs), max(s.prompt_len for s in seqs)), -1, dtype=np.int64)  # image run
    image_rows = []
    for b, (seq, offset, p) in enumerate(zip(seqs, offsets, prefix, strict=True)):
        for i, start in enumerate(seq.prompt.image_starts):
            groups[b, start : start + tokens_per_image] = i
            if i >= seq.first_image:  # its soft tokens from the prefix's end on (all of them, but
                first = max(start, p)  # for an image the cached prefix splits)
                image_rows.append(offset + first - p + np.arange(start + tokens_per_image - first))
    slots = [layout.prefill_slots(s.table, s.prompt_len, p, s.shared_len) for s, p in zip(seqs, prefix, strict=True)]

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
        prefix_slots = np.concatenate([layout.prefix_slots(s.table, p) for s, p in zip(seqs, prefix, strict=True)], 1)
        inputs["prefix"] = PrefixInputs(batch, dev(prefix_slots))
        inputs["layout"] = batch.queries
    return inputs


def suffix_image_embeds(seqs: list[Sequence]) -> list[torch.Tensor]:
    """[image tokens in the suffix, hidden] of each sequence: its images from `first_image` on,
    less the soft tokens of a split first one that lie in the cached prefix."""
    out = []
    for s in seqs:
        if s.images_in_suffix:
            cached = max(0, s.prefix_len - s.prompt.image_starts[s.first_image])
            out.append(s.image_embeds[s.first_image :].flatten(0, 1)[cached:])
    return out
