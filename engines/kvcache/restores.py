"""Restores: blocks from the host tier (or read from disk) into an admitted sequence's pages.

A restore is queued at admission. It starts when the device staging buffers of the restores in
flight stay under `max_bytes` (one always may), so a burst of hits cannot take GPU memory that
activations need; until then its host blocks are pinned in the host tier (a demotion cannot
reuse their slots). Starting: host hits are `HostTier.load`, one copy per run of consecutive
slots into a staging buffer on the copy stream; disk hits (pinned CPU blocks from the disk
reader) one more copy on the same stream. Landing (each step, once the copies' events have
completed): the main stream waits on them (no stall: they are done), one scatter kernel writes
the staging buffer into the pages, and the blocks become `ready`; the sequence's prefill, held
back until then, reads them later on the same stream. On CPU every copy is synchronous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from wicore.engines.kvcache.gpu_tier import Restore
from wicore.engines.kvcache.host_tier import HostTier, Transfer
from wicore.engines.kvcache.kv_layout import KVCache
from wicore.ops.transfer import upload

if TYPE_CHECKING:
    from wicore.engines.fast.sequence import Sequence


@dataclass
class Copy:
    """Blocks on their way into pages: `data` [n, *block_shape] on the device."""

    pages: list[int]  # n * G pages, block-major (each block's pages in group order)
    data: torch.Tensor
    transfer: Transfer
    source: torch.Tensor | None = None  # pinned host buffer the copy reads (kept until landed)


@dataclass
class RestoreJob:
    seq: Sequence
    in_host: list[Restore]
    from_disk: list[Restore]
    prefetched: dict  # key -> CPU block, for `from_disk`
    copies: list[Copy] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.in_host) + len(self.from_disk)

    def done(self) -> bool:
        return all(copy.transfer.done() for copy in self.copies)


class Restorer:
    def __init__(self, kv: KVCache, host: HostTier | None, block_shape: tuple, block_bytes: int, max_bytes: int):
        self.kv, self.host = kv, host
        self.block_shape, self.block_bytes, self.max_bytes = block_shape, block_bytes, max_bytes
        self.queued: deque[RestoreJob] = deque()
        self.running: list[RestoreJob] = []

    def queue(self, seq: Sequence, in_host: list[Restore], from_disk: list[Restore], prefetched: dict) -> None:
        missing = [r.key.hex()[:16] for r in from_disk if r.key not in prefetched]
        if missing:
            raise RuntimeError(f"blocks to restore are in no tier: {missing}")
        for restore in in_host:
            self.host.pin(restore.key)
        self.queued.append(RestoreJob(seq, in_host, from_disk, {r.key: prefetched[r.key] for r in from_disk}))
        self._launch()

    def land(self) -> None:
        """Scatter finished restores (main stream) and start queued ones; on CPU, until done."""
        while True:
            self._scatter_finished()
            if not self._launch():
                return

    def reset(self) -> None:
        for job in self.queued:
            for restore in job.in_host:
                self.host.unpin(restore.key)
        self.queued.clear()
        self.running.clear()

    def _launch(self) -> int:
        launched = 0
        while self.queued and (not self.running or self._bytes(self.running + [self.queued[0]]) <= self.max_bytes):
            job = self.queued.popleft()
            if job.in_host:
                data, transfer = self.host.load([r.key for r in job.in_host], self.kv.tensor.device)
                job.copies.append(Copy(_pages(job.in_host), data, transfer))
                for restore in job.in_host:
                    self.host.unpin(restore.key)  # the load is queued ahead of any store
            if job.from_disk:
                job.copies.append(self._upload(job.from_disk, job.prefetched))
                job.prefetched = {}
            self.running.append(job)
            launched += 1
        return launched

    def _scatter_finished(self) -> None:
        still = []
        for job in self.running:
            if not job.done():
                still.append(job)
                continue
            for copy in job.copies:
                copy.transfer.wait()  # the current (main) stream; complete already
                pages = upload(copy.pages, self.kv.tensor.device, torch.int64)
                self.kv.scatter_pages(pages, copy.data.view(-1, *copy.data.shape[2:]))
            for restore in job.seq.cache.restores:
                if restore.block is not None:
                    restore.block.ready = True
            job.seq.cache.restores = []
        self.running = still

    def _upload(self, restores: list[Restore], prefetched: dict) -> Copy:
        cuda = self.kv.tensor.is_cuda
        source = torch.empty((len(restores), *self.block_shape), dtype=self.kv.tensor.dtype, pin_memory=cuda)
        torch.stack([prefetched[r.key] for r in restores], out=source)
        if not cuda:
            return Copy(_pages(restores), source, Transfer())
        device = self.kv.tensor.device
        stream = self.host.copy_stream(device)
        with torch.cuda.stream(stream):
            data = torch.empty(source.shape, dtype=source.dtype, device=device)
            data.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Copy(_pages(restores), data, Transfer(event, device, [data]), source)

    def _bytes(self, jobs: list[RestoreJob]) -> int:
        return sum(job.num_blocks for job in jobs) * self.block_bytes


def _pages(restores: list[Restore]) -> list[int]:
    return [page for r in restores for page in r.pages]
