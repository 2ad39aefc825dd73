"""Attention backends for one forward pass: they hold the step's metadata, write each layer's
K/V into the paged cache and run the right kernel. The decoder calls `backend(layer, q, k, v)`.

- `PrefillAttention`: packed prompts, fresh K/V, Gemma-3's image-bidirectional causal masks, laid
  out once per step (`ops.attention.GroupedBatch`); prompts that start with cached positions also
  attend over the prefix K/V, gathered from the pages (`ops.prefix_attention`).
- `PagedAttention`: tokens that attend over the cache alone: decode (one token per sequence)
  and short prefill suffixes. Everything it derives (context lengths, decode's
  cache slots) is computed on the device from its inputs, so the same code runs inside a CUDA
  graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wicore.engines.kvcache.kv_layout import KVCache
from wicore.ops.attention import GroupedBatch, gather_kv, paged_attention, store_kv


@dataclass(frozen=True)
class LayerSpec:
    group: int
    window: int | None  # sliding window (keys with j > i - window), None on full layers
    scale: float  # query_pre_attn_scalar ** -0.5
    softcap: float | None


def layer_specs(text_config, cache: KVCache) -> list[LayerSpec]:
    specs = []
    for index, kind in enumerate(text_config.layer_types):
        group, _, _ = cache.layer(index)
        window = text_config.sliding_window if kind == "sliding_attention" else None
        specs.append(
            LayerSpec(group, window, text_config.query_pre_attn_scalar**-0.5, text_config.attn_logit_softcapping)
        )
    return specs


class PrefillAttention:
    def __init__(
        self,
        cache: KVCache,
        specs: list[LayerSpec],
        grouped: GroupedBatch,  # the step's padded layout and masks, shared by every layer
        slots: torch.Tensor,  # [G, N] int64 cache slot of each packed token, per layer group
        prefix_slots: torch.Tensor | None = None,  # [G, sum P] slots of cached prefix positions
    ):
        self.cache, self.specs, self.grouped, self.slots = cache, specs, grouped, slots
        self.prefix_slots = prefix_slots

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.specs[layer]
        _, k_cache, v_cache = self.cache.layer(layer)
        store_kv(k_cache, v_cache, k, v, self.slots[spec.group])
        keys, values = k, v
        if self.prefix_slots is not None:  # rows: the prefixes' (from the pages), then the suffixes'
            slots = self.prefix_slots[spec.group]  # never the new positions' slots
            keys = torch.cat([gather_kv(k_cache, slots, k.dtype), k])
            values = torch.cat([gather_kv(v_cache, slots, v.dtype), v])
        return self.grouped(q, keys, values, spec.window is not None, spec.scale, spec.softcap)


class PagedAttention:
    """Query tokens whose keys all sit in the pages: a decode step's tokens, or a short prefill
    suffix's (`prefill_batch.pages_only`). The tokens store their K/V, then each attends over
    positions 0 .. its own (its image's last, for an image's soft token) through its sequence's
    block table."""

    def __init__(
        self,
        cache: KVCache,
        specs: list[LayerSpec],
        tables: torch.Tensor,  # [G, rows, width] int32, persistent on the device
        rows: torch.Tensor,  # [N] int64 table row of each token's sequence
        positions: torch.Tensor,  # [N] int64 position of each token
        slots: torch.Tensor | None = None,  # [G, N] cache slots (prefill: some go to the null page)
        tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # see `ops.attention.paged_attention`
        ends: torch.Tensor | None = None,  # [N] int64 end of each token's visible keys (prefill)
    ):
        self.cache, self.specs, self.tables, self.rows, self.tiles = cache, specs, tables, rows, tiles
        layout = cache.layout
        self.context_lens = (positions + 1).to(torch.int32)
        self.ends = None if ends is None else ends.to(torch.int32)
        if slots is None:  # decode: the new token's slot in every group, computed on the device
            slots = []
            for g, group in enumerate(layout.groups):
                entry = (positions // layout.block_size) % group.ring
                pages = tables[g, rows, entry].long()
                slots.append(pages * layout.block_size + positions % layout.block_size)
        self.slots = slots

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.specs[layer]
        group, k_cache, v_cache = self.cache.layer(layer)
        store_kv(k_cache, v_cache, k, v, self.slots[group])
        ring = self.cache.layout.groups[group].ring
        return paged_attention(
            q,
            k_cache,
            v_cache,
            self.tables[group],
            self.rows,
            self.context_lens,
            spec.scale,
            ring,
            spec.window,
            spec.softcap,
            self.tiles,
            self.ends,
        )
