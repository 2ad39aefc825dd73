"""Bandwidth probes for the benchmark: restoring KV blocks from the pinned host tier into pages,
end to end, against a plain pinned host->device copy of the same bytes.

`measure_restores` stores N blocks (copied out of N x G free pages) in a fresh host tier, then
times the two ways a restore copies (engines/kvcache/restores.py), each with CUDA events on the
main stream (wall time on CPU), best of `repeats`:

- `per_run`: `HostTier.load` (one copy per run of consecutive slots into a staging buffer, on
  the copy stream) + the wait + the scatter kernel into the pages;
- `batched`: one cuMemcpyBatchAsync of every (block, group, layer, K/V) chunk straight into the
  pages + the wait (None where cuda-python or the driver lacks it, and on CPU).

The engine should be idle: the probe borrows free pages and writes garbage into them.
`restore_bandwidths` and `h2d_bandwidth` run the probes on a fast engine's pool and main stream.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np
import torch

from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.host_tier import HostTier
from wicore.engines.kvcache.kv_layout import KVCache
from wicore.engines.kvcache.restores import copy_chunks
from wicore.ops.transfer import BatchCopier, batch_copier, upload


def restore_bandwidths(engine, num_blocks: int, repeats: int = 3) -> dict[str, float | None]:
    """Bytes/s of restoring `num_blocks` KV blocks from a pinned host tier into the free pages of
    an idle `FastEngine`, end to end on its main stream, per way of copying (`measure_restores`;
    compare with `h2d_bandwidth`)."""
    runner = engine.runner
    copier = batch_copier(runner.device) if runner.cuda else None
    with torch.inference_mode(), runner.on_main_stream():
        return measure_restores(runner.cache, engine.blocks, engine.tiers.block_shape, num_blocks, repeats, copier)


def h2d_bandwidth(engine, num_bytes: int, repeats: int = 3) -> float:
    """Bytes/s of one plain pinned host->device copy of `num_bytes` on a `FastEngine`'s main stream."""
    with engine.runner.on_main_stream():
        return measure_h2d(num_bytes, engine.runner.device, repeats)


def measure_restores(
    kv: KVCache,
    blocks: BlockManager,
    block_shape: tuple[int, ...],
    num_blocks: int,
    repeats: int,
    copier: BatchCopier | None = None,
) -> dict[str, float | None]:
    """{"per_run": bytes/s, "batched": bytes/s or None} of a host-tier restore of `num_blocks`
    blocks into free pages."""
    groups = len(kv.layout.groups)
    if num_blocks < 1 or num_blocks * groups > blocks.num_free:
        raise ValueError(f"{num_blocks} blocks need {num_blocks * groups} free pages, {blocks.num_free} are free")
    device = kv.tensor.device
    tier = HostTier(num_blocks, block_shape, kv.tensor.dtype, pin_memory=device.type == "cuda")
    keys = [hashlib.sha256(b"restore-probe-%d" % i).digest() for i in range(num_blocks)]
    pages = blocks.allocate(num_blocks * groups)
    try:
        index = upload(pages, device, torch.int64)
        _, transfer = tier.store(keys, kv.gather_pages(index).view(num_blocks, *block_shape))
        transfer.synchronize()
        per_run = _best(device, repeats, lambda: _restore(tier, keys, kv, index))
        table = np.array(pages, dtype=np.int64).reshape(num_blocks, groups)
        batched = None
        if copier is not None:
            batched = _best(device, repeats, lambda: _restore_batched(tier, keys, kv, table, copier))
    finally:
        blocks.release(pages)
        tier.close()
    size = num_blocks * tier.block_bytes
    return {"per_run": size / per_run, "batched": None if batched is None else size / batched}


def measure_h2d(num_bytes: int, device: torch.device, repeats: int = 3) -> float:
    """Bytes per second of one pinned host->device copy of `num_bytes` (the restore's ceiling)."""
    cuda = device.type == "cuda"
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return num_bytes / _best(device, repeats, lambda: target.copy_(source, non_blocking=cuda))


def _restore(tier: HostTier, keys: list[bytes], kv: KVCache, pages: torch.Tensor) -> None:
    device = kv.tensor.device
    if device.type == "cuda":
        tier.copy_stream(device).wait_stream(torch.cuda.current_stream(device))  # start after the start event
    data, transfer = tier.load(keys, device)
    transfer.wait()
    kv.scatter_pages(pages, data.view(-1, *data.shape[2:]))


def _restore_batched(tier: HostTier, keys: list[bytes], kv: KVCache, table: np.ndarray, copier: BatchCopier) -> None:
    sources = tier.source_chunks(keys, kv.chunk_bytes).reshape(-1)
    copy_chunks(kv, tier, copier, kv.chunk_addresses(table), sources).wait()


def _best(device: torch.device, repeats: int, work: Callable[[], object]) -> float:
    return min(_timed(device, work) for _ in range(max(1, repeats)))


def _timed(device: torch.device, work: Callable[[], object]) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        work()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
