"""Restores: blocks from the host tier (or read from disk) into the pages of their owner (an
admitted sequence).

A restore is queued at admission, its host blocks pinned in the host tier (a demotion cannot
reuse their slots), and starts at the step's `land`, after that step's demotion has queued its
gather of the pages it evicted (they may be the pages this restore writes). It starts when the
device memory of the restores in flight stays under `max_bytes` (one always may), so a burst of
hits cannot take GPU memory that activations need.

Two ways to copy, on the host tier's copy stream:

- Batched (a `BatchCopier`, CUDA): every restore started in a step is one cuMemcpyBatchAsync
  straight into the pages, one copy per (block, group, layer, K/V) chunk (32 KiB on
  Gemma-3-4B): no staging buffer, no scatter kernel. The copy stream first waits for the main
  stream, whose queued work may still read the pages' previous contents.
- Per run (the fallback; CPU, no cuda-python, option `batched_copies` off): host hits are
  `HostTier.load`, one copy per run of consecutive slots into a staging buffer; disk hits
  (pinned CPU blocks from the disk reader) one more copy; landing scatters the staging buffer
  into the pages with one kernel on the main stream.

Landing (each step, once a restore's copies have completed): the main stream waits on their
event (no stall: they are done), the fallback's scatter runs, and the blocks become `ready`; the
sequence's prefill, held back until then, reads them later on the same stream. On CPU every copy
is synchronous.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from wicore.engines.kvcache.gpu_tier import Restore
from wicore.engines.kvcache.host_tier import HostTier, Transfer
from wicore.engines.kvcache.kv_layout import KVCache
from wicore.ops.transfer import BatchCopier, upload


class RestoreOwner(Protocol):
    """Whoever waits for restores (a sequence's cache record): its `restores` are marked ready
    and emptied once they land."""

    restores: list[Restore]


@dataclass
class Copy:
    """Blocks on their way into pages: `data` [n, *block_shape] on the device, to scatter; None
    when the copy writes the pages itself (batched)."""

    pages: list[int]  # n * G pages, block-major (each block's pages in group order)
    data: torch.Tensor | None
    transfer: Transfer
    sources: list[torch.Tensor] = field(default_factory=list)  # pinned host buffers the copy reads (kept until landed)


@dataclass
class RestoreJob:
    owner: RestoreOwner
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
    def __init__(
        self,
        kv: KVCache,
        host: HostTier | None,
        block_shape: tuple,
        block_bytes: int,
        max_bytes: int,
        copier: BatchCopier | None = None,
    ):
        self.kv, self.host = kv, host
        self.block_shape, self.block_bytes, self.max_bytes = block_shape, block_bytes, max_bytes
        self.copier = copier if kv.tensor.is_cuda else None
        self.queued: deque[RestoreJob] = deque()
        self.running: list[RestoreJob] = []

    def queue(self, owner: RestoreOwner, in_host: list[Restore], from_disk: list[Restore], prefetched: dict) -> None:
        missing = [r.key.hex()[:16] for r in from_disk if r.key not in prefetched]
        if missing:
            raise RuntimeError(f"blocks to restore are in no tier: {missing}")
        for restore in in_host:
            self.host.pin(restore.key)
        self.queued.append(RestoreJob(owner, in_host, from_disk, {r.key: prefetched[r.key] for r in from_disk}))

    def land(self) -> None:
        """Scatter finished restores (main stream) and start queued ones; on CPU, until done."""
        while True:
            self.land_finished()
            if not self.launch():
                return

    def launch(self) -> int:
        """Start the queued restores that fit the budget, in one batched copy when there is a
        copier; returns how many started."""
        jobs = []
        while self.queued and (not self.running or self._bytes(self.running + [self.queued[0]]) <= self.max_bytes):
            jobs.append(self.queued.popleft())
            self.running.append(jobs[-1])
        if self.copier is not None and jobs:
            self._launch_batched(jobs)
        else:
            for job in jobs:
                self._launch_per_run(job)
        return len(jobs)

    def reset(self) -> None:
        """Forget restores (after a failed step). A batched copy still writing pages is waited
        for: those pages go back to the pool and may be handed out at once."""
        for job in self.queued:
            for restore in job.in_host:
                self.host.unpin(restore.key)
        for job in self.running:
            for copy in job.copies:
                if copy.data is None:
                    copy.transfer.synchronize()
        self.queued.clear()
        self.running.clear()

    def _launch_per_run(self, job: RestoreJob) -> None:
        if job.in_host:
            data, transfer = self.host.load([r.key for r in job.in_host], self.kv.tensor.device)
            job.copies.append(Copy(_pages(job.in_host), data, transfer))
            self._unpin(job)
        if job.from_disk:
            job.copies.append(self._upload(job.from_disk, job.prefetched))
            job.prefetched = {}

    def _launch_batched(self, jobs: list[RestoreJob]) -> None:
        """One copy per chunk of every block of `jobs`, host and disk alike, in one call."""
        chunk = self.kv.chunk_bytes
        dsts, srcs, sources = [], [], []
        for job in jobs:
            restores = job.in_host + job.from_disk
            dsts.append(self.kv.chunk_addresses(np.array([r.pages for r in restores], dtype=np.int64)))
            if job.in_host:
                srcs.append(self.host.source_chunks([r.key for r in job.in_host], chunk).reshape(-1))
            for restore in job.from_disk:
                block = job.prefetched[restore.key]  # pinned and contiguous (the disk reader's)
                sources.append(block)
                srcs.append(np.uint64(block.data_ptr()) + np.arange(block.nbytes // chunk, dtype=np.uint64) * chunk)
        transfer = copy_chunks(self.kv, self.host, self.copier, np.concatenate(dsts), np.concatenate(srcs))
        for job in jobs:
            job.copies.append(Copy(_pages(job.in_host + job.from_disk), None, transfer, sources))
            self._unpin(job)  # the copy is queued ahead of any store into their slots
            job.prefetched = {}

    def _unpin(self, job: RestoreJob) -> None:
        for restore in job.in_host:
            self.host.unpin(restore.key)

    def land_finished(self) -> None:
        """Scatter the restores whose copies completed (main stream); start none."""
        still = []
        for job in self.running:
            if not job.done():
                still.append(job)
                continue
            for copy in job.copies:
                copy.transfer.wait()  # the current (main) stream; complete already
                if copy.data is not None:
                    pages = upload(copy.pages, self.kv.tensor.device, torch.int64)
                    self.kv.scatter_pages(pages, copy.data.view(-1, *copy.data.shape[2:]))
            for restore in job.owner.restores:
                if restore.block is not None:
                    restore.block.ready = True
            job.owner.restores = []
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
        return Copy(_pages(restores), data, Transfer(event, device, [data]), [source])

    def _bytes(self, jobs: list[RestoreJob]) -> int:
        return sum(job.num_blocks for job in jobs) * self.block_bytes


def copy_chunks(kv: KVCache, host: HostTier, copier: BatchCopier, dsts: np.ndarray, srcs: np.ndarray) -> Transfer:
    """Queue chunk copies srcs -> dsts (`kv.chunk_bytes` each, pages as destinations) as one
    batched copy on the host tier's copy stream, after the work the current stream has queued
    (the pages' previous users)."""
    device = kv.tensor.device
    stream = host.copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    copier.copy(dsts, srcs, np.full(len(dsts), kv.chunk_bytes, dtype=np.uint64), stream)
    event = torch.cuda.Event()
    event.record(stream)
    return Transfer(event, device)


def _pages(restores: list[Restore]) -> list[int]:
    return [page for r in restores for page in r.pages]
