"""The GPU tier of the prefix cache: full prompt blocks by chained hash.

A cached block is one logical block of a sequence that never wraps a sliding ring: one page in
each layer group (`KVLayout`), holding K/V of `block_size` prompt positions for every layer. Its
key is `wicore.engines.kvcache.block_hashes.block_hashes`' hash of the whole prefix up to it.

Life of a block: registered when the sequence that computes it (or restores it from a lower
tier) is admitted, with that sequence as its first user; `ready` once the work writing it is
queued on the main stream (a later prefill on that stream reads it safely). Sequences admitted
later take a use of it (`acquire`) and wait for `ready`. When its last user finishes it stays
cached and becomes evictable; the eviction policy picks victims among those only, so a block a
running sequence reads is never evicted. A block whose writer stops before writing it (an abort
before its prefill) while no one else uses it is discarded. Pages are owned by `BlockManager`;
this class only keeps the table, the users and the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.cache_stats import TierStats
from wicore.engines.kvcache.eviction import EvictionPolicy


@dataclass(eq=False)
class CachedBlock:
    key: BlockHash
    pages: tuple[int, ...]  # one page per layer group
    cost: float  # what recomputing it takes, relative to a text block (the policy's cost)
    users: int = 1  # admitted sequences holding it; its computing sequence is the first
    ready: bool = False  # its K/V are written, or queued on the main stream before any reader


@dataclass(frozen=True)
class Restore:
    """A block an admitted sequence brings up from the host or disk tier into its own pages."""

    key: BlockHash
    pages: tuple[int, ...]
    block: CachedBlock | None  # its entry in this cache (None: the key was cached already)


class PrefixCache:
    def __init__(self, policy: EvictionPolicy[BlockHash]):
        self.policy = policy
        self.blocks: dict[BlockHash, CachedBlock] = {}
        self.evictable_pages = 0  # pages of blocks without users
        self.stats = TierStats()  # hits / misses in blocks; evictions

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def match(self, keys: Sequence[BlockHash]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of `keys` (no side effects)."""
        found = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def insert(self, key: BlockHash, pages: tuple[int, ...], cost: float) -> CachedBlock:
        """A new block, in use by the sequence that registers it."""
        if key in self.blocks:
            raise KeyError(f"block {key.hex()[:16]} is cached already")
        block = CachedBlock(key, pages, cost)
        self.blocks[key] = block
        self.policy.insert(key, cost)
        self.policy.pin(key)
        return block

    def acquire(self, block: CachedBlock) -> None:
        """A sequence reads `block` (a hit): it cannot be evicted until released."""
        if block.users == 0:
            self.evictable_pages -= len(block.pages)
        block.users += 1
        self.policy.touch(block.key)
        self.policy.pin(block.key)

    def release(self, block: CachedBlock) -> None:
        if block.users <= 0:
            raise ValueError(f"block {block.key.hex()[:16]} has no users")
        block.users -= 1
        self.policy.unpin(block.key)
        if block.users == 0:
            self.evictable_pages += len(block.pages)

    def discard(self, block: CachedBlock) -> None:
        """Remove a block its one user (the sequence that registered it) never wrote."""
        if block.users != 1 or block.ready:
            raise ValueError(f"block {block.key.hex()[:16]} is in use or written; only an unwritten one goes")
        del self.blocks[block.key]
        self.policy.remove(block.key)

    def evict(self) -> CachedBlock | None:
        """Remove and return the policy's victim among blocks without users (None: none)."""
        key = self.policy.evict()
        if key is None:
            return None
        block = self.blocks.pop(key)
        self.evictable_pages -= len(block.pages)
        self.stats.evictions += 1
        return block

    def evictable_pages_without(self, blocks: Sequence[CachedBlock]) -> int:
        """Evictable pages once `blocks` (about to be acquired) are in use."""
        return self.evictable_pages - sum(len(b.pages) for b in blocks if b.users == 0)
