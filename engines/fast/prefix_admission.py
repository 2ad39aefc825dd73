"""Admitting a cached sequence: match its prompt's keys against the tiers, take the hits, and
register the blocks it will compute or restore.

A match walks the keys in order: first the blocks in the GPU pool (`PrefixCache`), then the next
ones a lower tier holds (`lower(seq, key)`: the host tier, or blocks prefetched from disk); it is
cut back by `usable_prefix` (the last token recomputed, no split image unless allowed). The GPU hits go into
the sequence's table as they are (shared pages); every other block gets fresh pages, the
restored ones are queued in `seq.cache.restores`, and all of them are registered in the cache at once,
so sequences admitted right after this one share them instead of recomputing them (they wait for
`ready`). Admission still reserves every page the sequence can ever need.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.gpu_tier import CachedBlock, Restore
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.kvcache.prefix_keys import PromptKeys, blocks_of, usable_prefix

if TYPE_CHECKING:
    from wicore.engines.fast.sequence import Sequence

LowerTiers = Callable[["Sequence", BlockHash], bool]


@dataclass
class PrefixMatch:
    gpu: list[CachedBlock]  # leading blocks found in the GPU pool
    lower: int  # the blocks after them, found in the host tier or prefetched from disk
    prefix_len: int  # prompt tokens not recomputed

    @property
    def num_blocks(self) -> int:
        return len(self.gpu) + self.lower


def match_prefix(
    seq: Sequence, keys: PromptKeys, blocks: BlockManager, lower: LowerTiers, block_size: int, split_images: bool
) -> PrefixMatch:
    gpu = blocks.cache.match(keys.keys)
    found = len(gpu)
    while found < len(keys.keys) and lower(seq, keys.keys[found]):
        found += 1
    prefix = usable_prefix(found, block_size, seq.prompt_len, keys.image_spans, split_images)
    used = blocks_of(prefix, block_size)
    return PrefixMatch(gpu[:used], max(0, used - len(gpu)), prefix)


def place_cached(
    seq: Sequence, keys: PromptKeys, blocks: BlockManager, layout: KVLayout, lower: LowerTiers, split_images: bool
) -> bool:
    """Give `seq` its pages and table with the cache's hits; False (nothing taken) when the
    pages do not fit yet."""
    found = match_prefix(seq, keys, blocks, lower, layout.block_size, split_images)
    groups = len(layout.groups)
    need = groups * (math.ceil(seq.max_len / layout.block_size) - len(found.gpu))
    if not blocks.can_allocate(need, found.gpu):
        return False
    blocks.acquire(found.gpu)
    fresh = blocks.allocate(need)
    block_pages = [b.pages for b in found.gpu] + [tuple(fresh[i : i + groups]) for i in range(0, need, groups)]
    seq.kv.pages = [page for pages in block_pages for page in pages]
    seq.kv.table = block_table(block_pages, layout)
    first = len(found.gpu)
    registered = [blocks.register(keys.keys[i], block_pages[i], keys.costs[i]) for i in range(first, len(keys.keys))]
    state = seq.cache
    state.reads = list(found.gpu)
    state.writes = [block for block in registered if block is not None]
    state.restores = [
        Restore(keys.keys[i], block_pages[i], registered[i - first]) for i in range(first, found.num_blocks)
    ]
    state.prefix_len = found.prefix_len
    state.first_image = sum(1 for _, end in keys.image_spans if end <= found.prefix_len)  # wholly cached
    state.shared_len = found.num_blocks * layout.block_size
    blocks.cache.stats.record(hits=len(found.gpu), misses=len(keys.keys) - len(found.gpu))
    return True


def block_table(block_pages: list[tuple[int, ...]], layout: KVLayout) -> np.ndarray:
    """[groups, width] int32 from each logical block's page per group (0 = null page)."""
    table = np.zeros((len(layout.groups), layout.table_width), dtype=np.int32)
    if block_pages:
        table[:, : len(block_pages)] = np.asarray(block_pages, dtype=np.int32).T
    return table
