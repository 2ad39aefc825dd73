"""KV blocks down to the host and disk tiers and back into pages, exactly, on CPU; the disk
tier's threads."""

from __future__ import annotations

import ctypes
import hashlib
import threading

import numpy as np
import pytest
import torch

from tests.test_fast_prefix_cache import layout
from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.fast.sequence import Sequence
from wicore.engines.fast.sequence_tiers import SequenceTiers
from wicore.engines.kvcache.disk_io import AsyncDiskTier
from wicore.engines.kvcache.disk_tier import DiskTier
from wicore.engines.kvcache.eviction import LRU
from wicore.engines.kvcache.gpu_tier import CachedBlock, PrefixCache, Restore
from wicore.engines.kvcache.host_tier import HostTier
from wicore.engines.kvcache.kv_layout import KVCache
from wicore.engines.kvcache.prefix_keys import PromptKeys
from wicore.engines.kvcache.tiers import KVTiers
from wicore.engines.pending import Pending
from wicore.ops.attention import KV_FP8
from wicore.schemas import GenerationParams

HEADS, DIM = 2, 8


def kv_cache(pages=32, device="cpu", dtype=torch.float32):
    cache = KVCache(layout(), pages, HEADS, DIM, dtype, device)
    if cache.tensor.dtype == torch.uint8:  # an FP8 cache's bytes: the tiers move any pattern as it is
        cache.tensor.copy_(torch.randint(0, 256, cache.tensor.shape, dtype=torch.uint8))
    else:
        cache.tensor.copy_(torch.randn(cache.tensor.shape))
    return cache


def key(i):
    return hashlib.sha256(b"%d" % i).digest()


def tiers(cache, host_blocks, disk=None, copier=None):
    shape = cache.layout.block_shape(HEADS, DIM)
    host = HostTier(host_blocks, shape, cache.tensor.dtype, pin_memory=cache.tensor.is_cuda, copier=copier)
    return KVTiers(cache, host, disk, 2**20, HEADS, DIM)


def victims(n, first_page=1):
    return [
        CachedBlock(key(i), (first_page + 2 * i, first_page + 2 * i + 1), 1.0, users=0, ready=True) for i in range(n)
    ]


def waiting_seq(keys, restores=()):
    request = EngineRequest("s", [], [], GenerationParams(max_new_tokens=1))
    seq = Sequence(request, Prompt([0] * 4 * len(keys), []), seed=0)
    seq.cache.keys = Pending.now(PromptKeys(list(keys), [1.0] * len(keys), ()))
    seq.cache.restores = list(restores)
    return seq


def pages_of(cache, pages):
    return cache.by_page[torch.tensor(pages)].clone()


def demoted(n, host_blocks=8, device="cpu", dtype=torch.float32, **kwargs):
    """(cache, tiers, blocks, their pages' contents) after `n` blocks were evicted and demoted."""
    cache = kv_cache(device=device, dtype=dtype)
    tier = tiers(cache, host_blocks, **kwargs)
    blocks = victims(n)
    before = pages_of(cache, [p for b in blocks for p in b.pages])
    tier.demote(blocks)
    return cache, tier, blocks, before


def test_an_fp8_cache_keeps_bytes_that_its_layers_see_as_e4m3():
    bf16, fp8 = kv_cache(dtype=torch.bfloat16), kv_cache(dtype=KV_FP8)
    assert fp8.tensor.dtype == torch.uint8 and fp8.chunk_bytes * 2 == bf16.chunk_bytes
    group, k, v = fp8.layer(1)
    bf16_group, bf16_k, _ = bf16.layer(1)
    assert k.dtype == v.dtype == KV_FP8 and (group, k.shape) == (bf16_group, bf16_k.shape) and k.shape == v.shape
    k[3, 1].fill_(-1.5)  # page 3, slot 1: the layer's view writes the cache's bytes
    page = fp8.by_page[3].view(KV_FP8)  # [slots, 2, block_size, kv_heads, D]
    assert torch.equal(page[fp8.layout.layer_place(1)[1], 0, 1].float(), torch.full((HEADS, DIM), -1.5))


@pytest.mark.parametrize("dtype", [torch.float32, KV_FP8])
def test_demoted_blocks_come_back_into_other_pages_exactly(dtype):
    cache, tier, blocks, before = demoted(3, dtype=dtype)
    assert all(b.key in tier.host for b in blocks) and tier.demoted_blocks == 3
    target = [CachedBlock(b.key, (20 + 2 * i, 21 + 2 * i), 1.0) for i, b in enumerate(blocks)]
    seq = waiting_seq([b.key for b in blocks], [Restore(t.key, t.pages, t) for t in target])
    assert SequenceTiers(tier).holds(seq, blocks[0].key)
    SequenceTiers(tier).start(seq)
    tier.land()
    assert seq.cache.restores == [] and all(t.ready for t in target)
    assert torch.equal(pages_of(cache, [p for t in target for p in t.pages]), before)
    assert tier.host.stats.hits == 3 and tier.restored_bytes == 3 * tier.block_bytes


@pytest.mark.parametrize("dtype", [torch.float32, KV_FP8])
def test_overflow_goes_to_disk_and_comes_back_through_a_prefetch(tmp_path, dtype):
    cache = kv_cache(dtype=dtype)
    disk = AsyncDiskTier(DiskTier(tmp_path, 2**20))
    tier = tiers(cache, host_blocks=1, disk=disk)
    blocks = victims(3)
    before = pages_of(cache, [p for b in blocks for p in b.pages])
    tier.demote(blocks)  # the host keeps the last (most valuable) one, the others spill
    disk.flush()
    assert blocks[2].key in tier.host and all(disk.might_have(b.key) for b in blocks[:2])
    seq = waiting_seq([b.key for b in blocks])
    seq.cache.disk_lookup = True
    SequenceTiers(tier).prefetch([seq], cache=None)  # no GPU tier: nothing to do
    assert seq.cache.prefetched is None
    SequenceTiers(tier).prefetch([seq], PrefixCache(LRU()))
    assert set(seq.cache.prefetched.value) == {blocks[0].key, blocks[1].key} and seq.cache.inputs_ready
    target = [CachedBlock(b.key, (20 + 2 * i, 21 + 2 * i), 1.0) for i, b in enumerate(blocks)]
    seq.cache.restores = [Restore(t.key, t.pages, t) for t in target]
    SequenceTiers(tier).start(seq)
    tier.land()
    assert torch.equal(pages_of(cache, [p for t in target for p in t.pages]), before)
    assert disk.stats.hits == 2
    tier.close()


def test_disk_writes_beyond_the_queue_are_dropped_and_failures_logged(tmp_path, caplog):
    disk = AsyncDiskTier(DiskTier(tmp_path, 2**20), max_pending=1)
    gate = threading.Event()
    disk._writer.submit(gate.wait)  # hold the writer
    assert disk.put(key(0), torch.zeros(4)) and not disk.put(key(1), torch.zeros(4))
    assert disk.dropped == 1
    gate.set()
    disk.flush()
    assert disk.might_have(key(0)) and disk.read_prefix([key(0), key(1)], (4,), torch.float32).result().keys() == {
        key(0)
    }
    assert disk.read_prefix([key(0)], (5,), torch.float32).result() == {}  # another shape: a miss
    disk.put(key(2), object())  # not a tensor: the writer logs the failure
    disk.flush()
    assert "writing block" in caplog.text
    disk.close()


def test_restores_beyond_the_staging_budget_wait_with_their_host_blocks_pinned():
    cache = kv_cache()
    shape = cache.layout.block_shape(HEADS, DIM)
    host = HostTier(8, shape, torch.float32, pin_memory=False)
    tier = KVTiers(cache, host, None, 2 * 4 * HEADS * DIM * 2 * 4, HEADS, DIM)  # one block of staging
    tier.max_demote = 2  # (the same budget caps copies down)
    blocks = victims(2)
    before = pages_of(cache, [p for b in blocks for p in b.pages])
    tier.demote(blocks)
    targets = [CachedBlock(b.key, (20 + 2 * i, 21 + 2 * i), 1.0) for i, b in enumerate(blocks)]
    seqs = [waiting_seq([b.key], [Restore(t.key, t.pages, t)]) for b, t in zip(blocks, targets)]
    for seq in seqs:
        SequenceTiers(tier).start(seq)
    assert not tier.restorer.running and len(tier.restorer.queued) == 2  # they start at the step's `land`
    assert all(host.policy.is_pinned(b.key) for b in blocks)
    assert tier.restorer.launch() == 1 and len(tier.restorer.queued) == 1
    assert host.policy.is_pinned(blocks[1].key) and not host.policy.is_pinned(blocks[0].key)
    tier.land()  # on CPU: the first lands, the second starts and lands
    assert all(s.cache.restores == [] for s in seqs) and not host.policy.num_pinned
    assert torch.equal(pages_of(cache, [p for t in targets for p in t.pages]), before)


def memmove(dsts, srcs, sizes):
    """The batched copy's contract (srcs[i] -> dsts[i], sizes[i] bytes) on host memory."""
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


def test_chunk_addresses_place_host_blocks_in_their_pages_exactly():
    # The batched restore's bookkeeping on CPU: host slot pieces -> (slot, k/v) rows of each page.
    cache, tier, blocks, before = demoted(3)
    table = np.array([[20, 23], [26, 21], [30, 28]])  # [blocks, groups], any free pages
    chunk = cache.chunk_bytes
    assert chunk == cache.layout.block_size * HEADS * DIM * 4 and tier.block_bytes % chunk == 0
    dsts = cache.chunk_addresses(table)
    srcs = tier.host.source_chunks([b.key for b in blocks], chunk).reshape(-1)
    assert len(dsts) == len(srcs) == 3 * tier.block_bytes // chunk
    memmove(dsts, srcs, np.full(len(dsts), chunk))
    assert torch.equal(pages_of(cache, table.reshape(-1).tolist()), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batched_copies_move_the_bytes_of_the_per_run_copies(tmp_path):
    # Demote (gather + batched store), spill to disk, prefetch, restore (batched, into pages) ==
    # the same flow with the per-run copies, byte for byte.
    pytest.importorskip("cuda.bindings")
    from wicore.ops.transfer import batch_copier

    copier = batch_copier(torch.device("cuda"))
    assert copier is not None
    results = []
    for path, batched in ((tmp_path / "a", copier), (tmp_path / "b", None)):
        torch.manual_seed(0)
        disk = AsyncDiskTier(DiskTier(path, 2**20))
        cache, tier, blocks, before = demoted(4, 2, "cuda", disk=disk, copier=batched)  # 2 spill to disk
        tier.disk.flush()
        seq = waiting_seq([b.key for b in blocks])
        seq.cache.disk_lookup = True
        SequenceTiers(tier).prefetch([seq], PrefixCache(LRU()))
        assert len(seq.cache.prefetched.value) == 2  # read from disk (pinned)
        target = [CachedBlock(b.key, (20 + 2 * i, 21 + 2 * i), 1.0) for i, b in enumerate(blocks)]
        seq.cache.restores = [Restore(t.key, t.pages, t) for t in target]
        SequenceTiers(tier).start(seq)
        while seq.cache.restores:
            tier.land()
        torch.cuda.synchronize()
        restored = pages_of(cache, [p for t in target for p in t.pages])
        assert torch.equal(restored, before)
        results.append(restored.cpu())
        tier.close()
    assert torch.equal(results[0], results[1])
