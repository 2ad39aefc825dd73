"""Attention backends for one forward pass: they hold the step's metadata, write each layer's
K/V into the paged cache and run the right kernel. The decoder calls `backend(layer, q, k, v)`.

- `PrefillAttention`: packed prompts, fresh K/V, Gemma-3's image-bidirectional causal masks, laid
  out once per step (`ops.attention.GroupedBatch`); prompts that start with cached positions also
  attend over the prefix K/V, gathered from the pages (`ops.prefix_attention`).
- `DecodeAttention`: one token per sequence, paged attention over the cache. Everything it
  derives (cache slots, context lengths) is computed on the device from `rows` / `positions`,
  so the same code runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wicore.engines.fast.kv_cache import KVCache
from wicore.ops.attention import GroupedBatch, paged_decode_attention, store_kv


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
            keys = torch.cat([k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots), k])
            values = torch.cat([v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots), v])
        return self.grouped(q, keys, values, spec.window is not None, spec.scale, spec.softcap)


class DecodeAttention:
    def __init__(
        self,
        cache: KVCache,
        specs: list[LayerSpec],
        tables: torch.Tensor,  # [G, rows, width] int32, persistent on the device
        rows: torch.Tensor,  # [B] int64 table row of each sequence
        positions: torch.Tensor,  # [B] int64 position of the token being decoded
    ):
        self.cache, self.specs, self.tables, self.rows = cache, specs, tables, rows
        layout = cache.layout
        self.context_lens = (positions + 1).to(torch.int32)
        self.slots = []  # per group: [B] cache slot of the new token
        for g, group in enumerate(layout.groups):
            entry = (positions // layout.block_size) % group.ring
            pages = tables[g, rows, entry].long()
            self.slots.append(pages * layout.block_size + positions % layout.block_size)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.specs[layer]
        group, k_cache, v_cache = self.cache.layer(layer)
        store_kv(k_cache, v_cache, k, v, self.slots[group])
        ring = self.cache.layout.groups[group].ring
        return paged_decode_attention(
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
        )
