"""The prefix cache below the GPU pool (a pinned host tier, a disk tier) and the copies that move
blocks between them and the KV pages. A block is one logical block: a page of every layer
group, [G, slots, 2, block_size, kv_heads, head_dim] (`KVLayout.block_shape`).

Down (`demote`, right after admission evicted GPU blocks): one gather of the victims' pages on
the main stream into a contiguous staging buffer, then `HostTier.store` copies it into the
pinned pool on the host tier's copy stream (one batched copy when the host tier has a
`BatchCopier`), behind an event of the main stream. The pages are
reused at once: every later write to them is queued after the gather on the same stream. A block
the host tier evicts goes to the disk tier's writer thread (a CPU copy); blocks the host tier
has no room for at all go there straight from the staging buffer (`_spill`). Nothing here waits
for the disk.

Up: `read_ahead` starts a disk read of a prompt's blocks (the reader thread, into pinned memory),
so admission can count those blocks as hits; `queue_restores` queues the restores of an owner (an
admitted sequence's cache record) and `land` starts them and lands finished ones in its pages
(`restores.Restorer`). Which sequences read ahead and when is the engine's
(`wicore.engines.fast.sequence_tiers`): nothing here knows a sequence.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.cache_stats import CacheStats
from wicore.engines.kvcache.disk_io import AsyncDiskTier
from wicore.engines.kvcache.gpu_tier import PrefixCache, Restore
from wicore.engines.kvcache.host_tier import HostTier
from wicore.engines.kvcache.kv_layout import KVCache
from wicore.engines.kvcache.restores import RestoreOwner, Restorer
from wicore.engines.pending import Pending
from wicore.ops.transfer import upload


class KVTiers:
    def __init__(
        self,
        kv: KVCache,
        host: HostTier | None,
        disk: AsyncDiskTier | None,
        max_staging_bytes: int,  # device buffers of copies in flight, each way
        kv_heads: int,
        head_dim: int,
    ):
        self.kv, self.host, self.disk = kv, host, disk
        self.cuda = kv.tensor.is_cuda
        self.block_shape = kv.layout.block_shape(kv_heads, head_dim)
        self.block_bytes = kv.tensor.element_size() * int(torch.Size(self.block_shape).numel())
        self.max_demote = max(1, max_staging_bytes // self.block_bytes)  # blocks staged per step
        self.copier = host.copier if host is not None and self.cuda else None  # batched copies, both ways
        self.restorer = Restorer(kv, host, self.block_shape, self.block_bytes, max_staging_bytes, self.copier)
        self.costs: dict[BlockHash, float] = {}  # of blocks in the host tier (for the disk's policy)
        self.restored_bytes = 0
        self.demoted_blocks = 0
        self.dropped_blocks = 0  # evicted without a copy down (over the per-step staging budget)
        if host is not None:
            host.on_evict = self._to_disk

    # -- lookups ----------------------------------------------------------------------------

    def in_host(self, key: BlockHash) -> bool:
        return self.host is not None and key in self.host

    def read_ahead(self, keys: list[BlockHash], gpu_hits: int) -> Pending[dict]:
        """Start reading from disk the run of a prompt's blocks that starts at or after its first
        block no upper tier holds (`gpu_hits` lead it in the GPU pool); key -> CPU block."""
        start = gpu_hits
        while start < len(keys) and self.in_host(keys[start]):
            start += 1
        rest = keys[start:]
        first = next((i for i, key in enumerate(rest) if self.disk.might_have(key)), None)
        if first is None:
            return Pending.now({})
        return Pending(self.disk.read_prefix(rest[first:], self.block_shape, self.kv.tensor.dtype, self.cuda))

    # -- up ---------------------------------------------------------------------------------

    def queue_restores(self, owner: RestoreOwner, prefetched: dict, lookups: int) -> None:
        """Queue the copies of `owner.restores` (host or `prefetched` blocks); `lookups`: the
        blocks it looked for below the GPU pool (the host tier's hit rate)."""
        restores: list[Restore] = owner.restores
        in_host = [r for r in restores if self.in_host(r.key)]
        from_disk = [r for r in restores if not self.in_host(r.key)]
        if self.host is not None:
            self.host.stats.record(hits=len(in_host), misses=max(0, lookups - len(in_host)))
        if restores:
            self.restorer.queue(owner, in_host, from_disk, prefetched)
            self.restored_bytes += len(restores) * self.block_bytes

    def land(self) -> None:
        """Scatter finished restores into their pages and start queued ones (`Restorer`)."""
        self.restorer.land()

    def land_finished(self) -> None:
        """Scatter finished restores into their pages; start none (they start behind a demotion)."""
        self.restorer.land_finished()

    # -- down -------------------------------------------------------------------------------

    def demote(self, victims) -> None:
        """Copy blocks evicted from the GPU pool (pages already reused) into the host tier; what
        it has no room for goes straight to the disk tier."""
        if not victims or self.host is None:
            return
        fresh = [b for b in reversed(victims) if b.key not in self.host]  # most valuable first
        staged = fresh[: self.max_demote]
        self.dropped_blocks += len(fresh) - len(staged)
        if not staged:
            return
        pages = upload([p for b in staged for p in b.pages], self.kv.tensor.device, torch.int64)
        data = self.kv.gather_pages(pages).view(len(staged), *self.block_shape)  # main stream
        stored, _ = self.host.store([b.key for b in staged], data, [b.cost for b in staged])
        stored_keys = set(stored)
        self.costs.update((b.key, b.cost) for b in staged if b.key in stored_keys)
        self.demoted_blocks += len(stored)
        overflow = [i for i, b in enumerate(staged) if b.key not in stored_keys]
        if overflow:
            self._spill([staged[i] for i in overflow], data, overflow)

    def _spill(self, blocks, data: torch.Tensor, rows: list[int]) -> None:
        """Blocks the host tier had no room for (all its slots pinned by this batch): one copy
        to pinned memory on the copy stream; the disk writer waits for its event."""
        room = self.disk.room() if self.disk is not None else 0
        self.dropped_blocks += len(blocks) - min(room, len(blocks))
        blocks, rows = blocks[:room], rows[:room]  # the most valuable first
        if not blocks:
            return
        picked = data.index_select(0, upload(rows, data.device, torch.int64))  # main stream
        event = None
        if self.cuda:
            stream = self.host.copy_stream(data.device)
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
                host.copy_(picked, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            picked.record_stream(stream)
        else:
            host = picked
        for index, block in enumerate(blocks):
            self.disk.put(block.key, host[index], block.cost, event)

    def _to_disk(self, key: BlockHash, view: torch.Tensor) -> None:
        """HostTier's eviction hook: the view is only valid during the call, so copy it (a
        ~0.5 ms memcpy per 4B block on this thread: skipped when the disk writer is behind)."""
        cost = self.costs.pop(key, 1.0)
        if self.disk is not None and self.disk.room():
            self.disk.put(key, view.clone(), cost)
        elif self.disk is not None:
            self.disk.dropped += 1

    # -- the rest ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget restores in flight (after a failed step)."""
        self.restorer.reset()

    def cache_stats(self, cache: PrefixCache | None) -> CacheStats:
        stats = CacheStats()
        if cache is not None:
            gpu = cache.stats
            stats.tiers["gpu"] = replace(gpu, bytes_in=self.restored_bytes, bytes_out=gpu.hits * self.block_bytes)
        if self.host is not None:
            stats.tiers["host"] = replace(self.host.stats)
        if self.disk is not None:
            stats.tiers["disk"] = self.disk.stats
        return stats

    def counters(self) -> dict[str, int]:
        """Block movements the per-tier stats do not show."""
        return {
            "kv_blocks_demoted": self.demoted_blocks,  # GPU -> host copies
            "kv_blocks_dropped": self.dropped_blocks + (self.disk.dropped if self.disk is not None else 0),
            "kv_restores_queued": len(self.restorer.queued) + len(self.restorer.running),
        }

    def close(self) -> None:
        """Stop the disk tier's threads and let go of the KV pool and the pinned host pool: the
        scheduler still holds `SequenceTiers.holds` after the engine closes, and the host tier's eviction
        hook points back here."""
        if self.disk is not None:
            self.disk.close()
        if self.host is not None:
            self.host.on_evict = None
            self.host.close()
        self.kv = self.host = self.disk = self.restorer = None
