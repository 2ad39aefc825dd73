"""How the KV cache is laid out: layer groups, pages, per-sequence block tables.

Layers are split into groups of equal size `slots` (vLLM's hybrid-allocator idea): one group of
Gemma-3-4B's 5 full-attention layers, six groups of its 29 sliding layers (the last one a slot
short). One physical page holds `block_size` tokens of K and V for every layer of one group, so
all groups draw from a single pool and memory follows what each group really needs:
full-attention groups get a page per `block_size` tokens of the sequence, sliding groups a ring
of at most ceil(window / block_size) + 1 pages (position t lives in table entry
(t // block_size) % ring; what a page held before is out of the window by then).

Cache tensor: [slots, 2 (k/v), pages, block_size, kv_heads, head_dim]; the view of one layer,
`cache[slot, 0]`, is a contiguous [pages, block_size, kv_heads, head_dim]. Page 0 is the null
page: unused table entries and padded batch rows point at it. An FP8 cache's tensor holds bytes
(`kv_storage_dtype`): the tiers copy them as they are; the layers' views are FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from wicore.ops.attention import kv_storage_dtype

NULL_PAGE = 0
SLIDING, FULL = "sliding_attention", "full_attention"  # a Gemma-3 config's layer_types


@dataclass(frozen=True)
class KVGroup:
    sliding: bool
    layers: tuple[int, ...]
    ring: int  # table entries the group cycles through (== table width when not sliding)


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    window: int | None
    groups: tuple[KVGroup, ...]
    slots: int  # layers per page
    table_width: int  # blocks of a max_model_len sequence

    @classmethod
    def build(cls, text_config, block_size: int, max_model_len: int) -> KVLayout:
        width = math.ceil(max_model_len / block_size)
        window = text_config.sliding_window
        by_kind: dict[bool, list[int]] = {}
        for index, kind in enumerate(text_config.layer_types):
            by_kind.setdefault(kind == SLIDING, []).append(index)
        slots = min(len(layers) for layers in by_kind.values())
        ring = min(width, math.ceil(window / block_size) + 1) if window else width
        groups = tuple(
            KVGroup(sliding, tuple(layers[i : i + slots]), ring if sliding else width)
            for sliding, layers in sorted(by_kind.items())
            for i in range(0, len(layers), slots)
        )
        return cls(block_size, window if True in by_kind else None, groups, slots, width)

    def layer_place(self, layer: int) -> tuple[int, int]:
        """(group index, slot within the page) of a layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(layer)

    def blocks(self, group: KVGroup, num_tokens: int) -> int:
        return min(math.ceil(num_tokens / self.block_size), group.ring)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` positions holds in all groups together."""
        return sum(self.blocks(g, num_tokens) for g in self.groups)

    def page_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return self.slots * 2 * self.block_size * kv_heads * head_dim * dtype.itemsize

    def wraps(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` positions cycles through a sliding ring (its early
        pages get overwritten: the prefix cache neither keeps nor reuses its blocks)."""
        return any(g.sliding and math.ceil(num_tokens / self.block_size) > g.ring for g in self.groups)

    def prefill_slots(self, table: np.ndarray, length: int, start: int = 0, shared: int = 0) -> np.ndarray:
        """Cache slots [G, length - start] for a prompt's positions start..length-1, given the
        sequence's table [G, width]. Go to the null page: positions below `shared` (blocks taken
        from the prefix cache hold them already, and other sequences may be reading them), and on
        sliding groups the positions a later position of the same prompt overwrites (two writes
        to one slot in one index_copy_ would be undefined; they are out of the window anyway).
        A sequence that never wraps its ring keeps every position, so its blocks can be cached."""
        pos = np.arange(start, length)
        out = np.empty((len(self.groups), len(pos)), dtype=np.int64)
        for g, group in enumerate(self.groups):
            pages = table[g, (pos // self.block_size) % group.ring]
            out[g] = pages * self.block_size + pos % self.block_size
            dropped = pos < shared
            if group.sliding:
                dropped |= pos < length - group.ring * self.block_size
            out[g, dropped] = NULL_PAGE * self.block_size
        return out

    def prefix_slots(self, table: np.ndarray, length: int) -> np.ndarray:
        """Cache slots [G, length] of positions 0..length-1 of a sequence that never wraps."""
        pos = np.arange(length)
        return table[:, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

    def block_shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One logical block (a page of every group) copied out of the cache:
        [groups, slots, 2 (k/v), block_size, kv_heads, head_dim]."""
        return (len(self.groups), self.slots, 2, self.block_size, kv_heads, head_dim)


class KVCache:
    """The cache tensor and per-layer views of it."""

    def __init__(self, layout: KVLayout, num_pages: int, kv_heads: int, head_dim: int, dtype, device):
        self.layout = layout
        self.num_pages = num_pages
        self.dtype = dtype  # of the K/V the layers read and write; `tensor` may hold its bytes
        shape = (layout.slots, 2, num_pages, layout.block_size, kv_heads, head_dim)
        self.tensor = torch.zeros(shape, dtype=kv_storage_dtype(dtype), device=device)
        self._places = [layout.layer_place(i) for i in range(sum(len(g.layers) for g in layout.groups))]

    def layer(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(group index, k cache, v cache) of a layer; caches: [pages, block_size, kv_heads, D]."""
        group, slot = self._places[index]
        return group, self.tensor[slot, 0].view(self.dtype), self.tensor[slot, 1].view(self.dtype)

    @property
    def by_page(self) -> torch.Tensor:
        """A view [pages, slots, 2, block_size, kv_heads, head_dim]: page-major, for copying
        whole pages in and out (one gather / scatter kernel, not one per layer)."""
        return self.tensor.permute(2, 0, 1, 3, 4, 5)

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """pages [n] int64 on the device -> a new contiguous [n, slots, 2, bs, kv_heads, D]."""
        return self.by_page[pages]

    def scatter_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Write data [n, slots, 2, bs, kv_heads, D] into pages [n] (distinct)."""
        self.tensor.index_copy_(2, pages, data.permute(1, 2, 0, 3, 4, 5))

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one layer's K or V in one page, [block_size, kv_heads, head_dim]: the largest
        piece of a page that is contiguous in the cache tensor."""
        return self.tensor[0, 0, 0].numel() * self.tensor.element_size()

    def chunk_addresses(self, pages: np.ndarray) -> np.ndarray:
        """Device addresses of the chunks of blocks whose pages are `pages` [n, G] (block-major,
        groups in order), in a block's own order [G, slots, 2]: uint64 [n * G * slots * 2]. Chunk
        (slot, k/v) of page p starts at element ((slot * 2 + kv) * num_pages + p) * chunk."""
        rows = np.arange(self.layout.slots * 2, dtype=np.uint64) * np.uint64(self.num_pages)
        index = rows[None, None, :] + np.asarray(pages, dtype=np.uint64)[:, :, None]
        return (np.uint64(self.tensor.data_ptr()) + index * np.uint64(self.chunk_bytes)).reshape(-1)
