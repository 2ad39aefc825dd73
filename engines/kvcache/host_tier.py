"""A CPU pool for KV blocks moved down from the GPU, indexed by prefix block hash.

The pool is one preallocated tensor [num_blocks, *block_shape] in one page-aligned host
allocation, page-locked once when CUDA is available (`PinnedHostBuffer`: exactly its size, where
PyTorch's pinned allocator would round it up to a power of two), so a block is one contiguous
slot. With a CUDA source or destination, copies run on a dedicated copy stream and return a
`Transfer` (a CUDA event) at once, so a restore can overlap compute; on CPU everything is
synchronous and the Transfer is already done. Given a `BatchCopier`, a store queues all its runs
of slots in one driver call, and `source_chunks` hands a restore the host addresses it copies
straight into pages (`restores`); without one, each run of consecutive slots is one copy.

Ordering on CUDA: every copy in or out of the pool runs on the one copy stream, so a slot
evicted and rewritten after a queued load is never overwritten before that load has read it.
Only CPU code that touches the pool (`read`, and stores from CPU tensors) has to wait for the
stream; those two do so themselves.

Block layout: whatever the engine's block is, e.g. [2, layers, block_size, kv_heads, head_dim]
for K and V of all layers. An engine whose cache is [2, layers, num_blocks, ...] gathers
`kv[:, :, ids].movedim(2, 0)` on its compute stream and passes that: once the gather is queued,
the GPU blocks are free to reuse, and the staging tensor is kept alive until the copy has read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.cache_stats import TierStats
from wicore.engines.kvcache.eviction import LRU, EvictionPolicy
from wicore.ops.transfer import BatchCopier, PinnedHostBuffer

# (hash, CPU view of the block): called before the slot is reused, so the view is valid only
# during the call; copy or write it out (e.g. to the disk tier) before returning.
EvictHook = Callable[[BlockHash, torch.Tensor], None]


@dataclass
class Transfer:
    """Copies in flight. `tensors` are device tensors the copies write or read."""

    event: torch.cuda.Event | None = None  # None: already done (CPU)
    device: torch.device | None = None  # the CUDA device of the copy stream
    tensors: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the host until the copies are done."""
        if self.event is not None:
            self.event.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copies, without blocking the
        host, and keep the device tensors alive for that stream's later use."""
        if self.event is None:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for tensor in self.tensors:
            tensor.record_stream(stream)


class HostTier:
    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        policy: EvictionPolicy[BlockHash] | None = None,
        pin_memory: bool | None = None,
        on_evict: EvictHook | None = None,
        copier: BatchCopier | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.block_shape = tuple(block_shape)
        self.memory = PinnedHostBuffer(num_blocks * math.prod(self.block_shape) * dtype.itemsize, pin_memory)
        self.pool = self.memory.tensor.view(dtype).view(num_blocks, *self.block_shape)
        self.copier = copier
        self.policy: EvictionPolicy[BlockHash] = policy if policy is not None else LRU()
        self.on_evict = on_evict
        self.stats = TierStats()
        self._slots: dict[BlockHash, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> event of the store writing it
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[0]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.pool.element_size()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def match_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` are here (chained hashes: a prefix hit). Counts the matched
        blocks as hits and the rest as misses."""
        n = 0
        while n < len(hashes) and hashes[n] in self._slots:
            n += 1
        self.stats.record(hits=n, misses=len(hashes) - n)
        return n

    def store(
        self, hashes: Sequence[BlockHash], blocks: torch.Tensor, costs: Sequence[float] | None = None
    ) -> tuple[list[BlockHash], Transfer]:
        """Copy blocks [n, *block_shape] in under `hashes`, evicting by policy for room. Hashes
        already here are touched, not copied. Returns the hashes stored (fewer when every other
        block is pinned) and the copies in flight."""
        self._check_blocks(hashes, blocks)
        with self.stats.timed():
            picks = self._claim_slots(hashes, costs)
            if not picks:
                transfer = Transfer()
            elif blocks.device.type == "cuda":
                transfer = self._store_async(blocks, picks)
            else:
                self._sync_copy_stream()  # a queued load may still read a reclaimed slot
                for index, slot in picks:
                    self.pool[slot].copy_(blocks[index])
                transfer = Transfer()
            self.stats.bytes_in += len(picks) * self.block_bytes
        return [hashes[i] for i, _ in picks], transfer

    def load(self, hashes: Sequence[BlockHash], device: torch.device | str = "cpu") -> tuple[torch.Tensor, Transfer]:
        """The blocks [n, *block_shape] under `hashes` (all must be here: see `match_prefix`),
        as a new tensor on `device`. On CUDA call `transfer.wait()` before using it."""
        with self.stats.timed():
            slots = self._take(hashes)
            device = torch.device(device)
            out, transfer = self._load_async(slots, device) if device.type == "cuda" else self._load_sync(slots, device)
        return out, transfer

    def source_chunks(self, hashes: Sequence[BlockHash], chunk_bytes: int) -> np.ndarray:
        """Host addresses [n, block_bytes // chunk_bytes] (uint64) of the blocks under `hashes`,
        each cut into `chunk_bytes` pieces in its own order, for a batched copy the caller queues
        on `copy_stream` (queued there, it reads after every store before it). Counted as a load."""
        with self.stats.timed():
            slots = np.asarray(self._take(hashes), dtype=np.uint64)
        pieces = np.arange(self.block_bytes // chunk_bytes, dtype=np.uint64) * np.uint64(chunk_bytes)
        first = np.uint64(self.pool.data_ptr()) + slots * np.uint64(self.block_bytes)
        return first[:, None] + pieces[None, :]

    def read(self, block_hash: BlockHash) -> torch.Tensor:
        """A CPU view of one block (waits for the store that wrote it). Valid until evicted."""
        slot = self._slots[block_hash]
        self._wait_slot(slot)
        return self.pool[slot]

    def pin(self, block_hash: BlockHash) -> None:
        self.policy.pin(block_hash)

    def unpin(self, block_hash: BlockHash) -> None:
        self.policy.unpin(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        """Drop a block without calling `on_evict`."""
        self.policy.remove(block_hash)
        self._free.append(self._slots.pop(block_hash))

    def close(self) -> None:
        """Wait for the copies in flight, then unpin the pool (the tier is unusable after)."""
        self._sync_copy_stream()
        self.memory.close()

    # -- internals -------------------------------------------------------------------------

    def _take(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots of `hashes` (all must be here), touched in the policy and counted as read."""
        missing = [h.hex()[:16] for h in hashes if h not in self._slots]
        if missing:
            raise KeyError(f"blocks not in the host tier: {missing}")
        for h in hashes:
            self.policy.touch(h)
        self.stats.bytes_out += len(hashes) * self.block_bytes
        return [self._slots[h] for h in hashes]

    def _check_blocks(self, hashes: Sequence[BlockHash], blocks: torch.Tensor) -> None:
        if tuple(blocks.shape) != (len(hashes), *self.block_shape):
            raise ValueError(f"blocks are {tuple(blocks.shape)}, expected {(len(hashes), *self.block_shape)}")
        if blocks.dtype != self.pool.dtype:
            raise ValueError(f"blocks are {blocks.dtype}, the pool is {self.pool.dtype}")

    def _claim_slots(self, hashes: Sequence[BlockHash], costs: Sequence[float] | None) -> list[tuple[int, int]]:
        """(index into the batch, slot) for each new hash that gets a slot."""
        picks: list[tuple[int, int]] = []
        for index, block_hash in enumerate(hashes):
            if block_hash in self._slots:
                self.policy.touch(block_hash)
                continue
            slot = self._free_slot()
            if slot is None:
                break
            self._slots[block_hash] = slot
            self.policy.insert(block_hash, costs[index] if costs else 1.0)
            self.policy.pin(block_hash)  # not a victim for the rest of this batch
            picks.append((index, slot))
        for index, _ in picks:
            self.policy.unpin(hashes[index])
        return picks

    def _free_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self.policy.evict()
        if victim is None:
            return None
        slot = self._slots.pop(victim)
        if self.on_evict is not None:
            self._wait_slot(slot)
            self.on_evict(victim, self.pool[slot])
        self.stats.evictions += 1
        return slot

    def _store_async(self, blocks: torch.Tensor, picks: list[tuple[int, int]]) -> Transfer:
        if self.copier is not None:
            blocks = blocks.contiguous()  # addressed by pointer arithmetic; a copy stays on this stream
        stream = self.copy_stream(blocks.device)
        stream.wait_stream(torch.cuda.current_stream(blocks.device))  # blocks were written there
        with torch.cuda.stream(stream):
            if self.copier is not None:
                self._store_batched(blocks, picks, stream)
            else:
                for index, slot, count in _runs(picks):  # one DMA per run of consecutive slots
                    self.pool[slot : slot + count].copy_(blocks[index : index + count], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        blocks.record_stream(stream)  # not reused by the compute stream before the copy reads it
        for _, slot in picks:
            self._pending[slot] = event
        return Transfer(event, blocks.device, [blocks])

    def _store_batched(self, blocks: torch.Tensor, picks: list[tuple[int, int]], stream: torch.cuda.Stream) -> None:
        """Every run of consecutive slots as one copy of a single batched call."""
        runs = np.array(_runs(picks), dtype=np.uint64).reshape(-1, 3)  # (index, slot, count)
        size = np.uint64(self.block_bytes)
        srcs = np.uint64(blocks.data_ptr()) + runs[:, 0] * size
        dsts = np.uint64(self.pool.data_ptr()) + runs[:, 1] * size
        self.copier.copy(dsts, srcs, runs[:, 2] * size, stream)

    def _load_async(self, slots: list[int], device: torch.device) -> tuple[torch.Tensor, Transfer]:
        stream = self.copy_stream(device)
        with torch.cuda.stream(stream):
            # allocated on the copy stream: it need not wait for the compute stream's frees
            out = torch.empty((len(slots), *self.block_shape), dtype=self.pool.dtype, device=device)
            for index, slot, count in _runs(list(enumerate(slots))):  # one DMA per run of slots
                out[index : index + count].copy_(self.pool[slot : slot + count], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return out, Transfer(event, device, [out])

    def _load_sync(self, slots: list[int], device: torch.device) -> tuple[torch.Tensor, Transfer]:
        for slot in slots:
            self._wait_slot(slot)
        out = self.pool[torch.tensor(slots, dtype=torch.long)]  # advanced indexing copies
        return out.to(device), Transfer()

    def _wait_slot(self, slot: int) -> None:
        event = self._pending.pop(slot, None)
        if event is not None:
            event.synchronize()

    def _sync_copy_stream(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        self._pending.clear()

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream every copy in or out of the pool runs on (other copies that must stay
        ordered with them, e.g. an engine's uploads of blocks read from disk, may use it too)."""
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(index, slot) pairs -> (index, slot, count) runs where both advance by one: a restore of
    blocks stored together is a few large copies, not one per block."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in pairs:
        if runs and runs[-1][0] + runs[-1][2] == index and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, slot, 1))
    return runs
