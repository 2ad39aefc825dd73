"""A `DiskTier` behind threads, so an engine loop never waits on the disk.

Writes (blocks demoted from the host tier) queue on a writer thread, at most `max_pending`
at once (more are dropped and counted: the disk cannot keep up, and memory must stay bounded).
Reads run on `readers` threads: `read_prefix` returns a Future of the leading blocks found, one
sequence's prefix per task. The tier reads and writes its files outside its own lock, so reads
run beside the write in progress and beside each other: a block costs a file read and a sha256,
so several readers read faster than one, and a sequence waiting for its blocks waits for that. `might_have` is a lock-free hint for the engine
thread (a dict lookup, atomic under the GIL): a stale answer costs a wasted read or a missed
hit, never a wrong block (reads check key, checksum, shape and dtype).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.cache_stats import TierStats
from wicore.engines.kvcache.disk_tier import DiskTier

log = logging.getLogger(__name__)


READERS = 4  # read threads: 1.6x one thread's rate from a cold page cache (above)


class AsyncDiskTier:
    def __init__(self, tier: DiskTier, max_pending: int = 64, readers: int = READERS):
        self.tier = tier
        self.max_pending = max_pending
        self.dropped = 0  # writes refused because `max_pending` were queued
        self._pending = 0
        self._count_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="wicore-disk-write")
        self._reader = ThreadPoolExecutor(readers, thread_name_prefix="wicore-disk-read")

    def might_have(self, key: BlockHash) -> bool:
        return key in self.tier

    def room(self) -> int:
        """Writes a `put` would queue now (check before making copies for them)."""
        return max(0, self.max_pending - self._pending)

    def put(self, key: BlockHash, tensor: torch.Tensor, cost: float = 1.0, ready=None) -> bool:
        """Queue a write of `tensor` (a CPU tensor the caller no longer touches; when `ready`, a
        CUDA event, is given, a copy into it still in flight that the writer waits for); False
        when dropped because too many writes are queued."""
        with self._count_lock:
            if self._pending >= self.max_pending:
                self.dropped += 1
                return False
            self._pending += 1
        self._writer.submit(self._put, key, tensor, cost, ready)
        return True

    def read_prefix(
        self, keys: Sequence[BlockHash], shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False
    ) -> Future:
        """A Future of {key: CPU tensor} for the leading `keys` on disk with this shape and
        dtype (pinned when `pin`), up to the first one that is not."""
        return self._reader.submit(self._read_prefix, list(keys), tuple(shape), dtype, pin)

    @property
    def stats(self) -> TierStats:
        return dataclasses.replace(self.tier.stats)

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
        self.tier.close()

    def _put(self, key: BlockHash, tensor: torch.Tensor, cost: float, ready) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # this thread waits for the copy, never the engine's
            self.tier.put(key, tensor, cost)
        except Exception:  # a thread's failure would vanish into its Future: log it
            log.exception("disk tier: writing block %s failed", key.hex()[:16])
        finally:
            with self._count_lock:
                self._pending -= 1

    def _read_prefix(self, keys: list[BlockHash], shape, dtype, pin: bool) -> dict[BlockHash, torch.Tensor]:
        found: dict[BlockHash, torch.Tensor] = {}
        for key in keys:
            tensor = self.tier.get(key)
            if tensor is None:
                break
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                log.warning(
                    "disk tier: block %s is %s %s, expected %s %s",
                    key.hex()[:16],
                    tensor.dtype,
                    tuple(tensor.shape),
                    dtype,
                    shape,
                )
                break
            found[key] = tensor.pin_memory() if pin else tensor
        return found
