import mmap

import numpy as np
import pytest
import torch

from wicore.engines.kvcache.block_hashes import block_hashes
from wicore.engines.kvcache.eviction import A2CR
from wicore.engines.kvcache.host_tier import HostTier

BLOCK = (2, 3, 4, 2, 8)  # [K/V, layers, block_size, kv_heads, head_dim]


def hashes(n, salt="m"):
    return block_hashes(list(range(16 * n)), 16, model_id=salt)


def blocks(n, dtype=torch.bfloat16):
    return torch.randn(n, *BLOCK).to(dtype)


def test_store_load_round_trip_is_exact():
    tier = HostTier(8, BLOCK, torch.bfloat16, pin_memory=False)
    keys, data = hashes(5), blocks(5)
    stored, transfer = tier.store(keys, data)
    assert stored == keys and transfer.done()
    out, transfer = tier.load([keys[3], keys[0]])
    transfer.wait()
    assert torch.equal(out, data[[3, 0]])
    assert tier.stats.bytes_in == 5 * data[0].numel() * 2 and tier.stats.bytes_out == 2 * data[0].numel() * 2


def test_pool_is_one_preallocated_page_aligned_allocation_of_exactly_its_size():
    tier = HostTier(3, BLOCK, torch.float16, pin_memory=False)
    assert tier.pool.shape == (3, *BLOCK) and tier.pool.dtype == torch.float16
    assert tier.block_bytes == tier.pool[0].numel() * 2
    assert tier.memory.tensor.numel() == 3 * tier.block_bytes  # no rounding up to a power of two
    assert tier.pool.data_ptr() == tier.memory.tensor.data_ptr() and tier.pool.data_ptr() % mmap.PAGESIZE == 0
    assert not tier.memory.registered and torch.count_nonzero(tier.pool) == 0
    tier.close()  # nothing to unpin on CPU; the memory stays readable while the pool is referenced
    assert tier.pool.sum() == 0


def test_source_chunks_are_the_slots_addresses_cut_in_pieces():
    tier = HostTier(4, BLOCK, torch.float32, pin_memory=False)
    keys, data = hashes(3), blocks(3, torch.float32)
    tier.store(keys, data)
    chunk = tier.block_bytes // 6  # [K/V, layers] pieces of [block_size, kv_heads, head_dim]
    chunks = tier.source_chunks([keys[2], keys[0]], chunk)
    assert chunks.shape == (2, 6) and chunks.dtype == np.uint64
    base = tier.pool.data_ptr()
    assert chunks[0, 0] == base + 2 * tier.block_bytes and chunks[1, 5] == base + 5 * chunk
    assert tier.stats.bytes_out == 2 * tier.block_bytes
    with pytest.raises(KeyError):
        tier.source_chunks(hashes(1, salt="other"), chunk)


def test_match_prefix_counts_leading_blocks():
    tier = HostTier(8, BLOCK, torch.bfloat16, pin_memory=False)
    keys = hashes(4)
    tier.store(keys[:2], blocks(2))
    assert tier.match_prefix(keys) == 2
    assert (tier.stats.hits, tier.stats.misses) == (2, 2)


def test_eviction_by_policy_calls_the_hook_with_the_block():
    evicted = {}
    tier = HostTier(3, BLOCK, torch.float32, pin_memory=False, on_evict=lambda h, b: evicted.update({h: b.clone()}))
    keys, data = hashes(4), blocks(4, torch.float32)
    tier.store(keys[:3], data[:3])
    tier.load([keys[0]])  # keys[0] recently used: keys[1] is the LRU victim
    tier.store(keys[3:], data[3:])
    assert list(evicted) == [keys[1]] and torch.equal(evicted[keys[1]], data[1])
    assert keys[1] not in tier and all(k in tier for k in (keys[0], keys[2], keys[3]))
    assert tier.stats.evictions == 1


def test_pinned_blocks_stay_and_a_full_pinned_pool_stores_nothing():
    tier = HostTier(2, BLOCK, torch.float32, pin_memory=False)
    keys = hashes(4)
    tier.store(keys[:2], blocks(2, torch.float32))
    tier.pin(keys[0])
    tier.pin(keys[1])
    stored, _ = tier.store(keys[2:], blocks(2, torch.float32))
    assert stored == [] and len(tier) == 2
    tier.unpin(keys[1])
    stored, _ = tier.store(keys[2:], blocks(2, torch.float32))
    assert stored == [keys[2]] and keys[0] in tier


def test_a_batch_never_evicts_its_own_blocks():
    tier = HostTier(2, BLOCK, torch.float32, pin_memory=False)
    keys = hashes(3)
    stored, _ = tier.store(keys, blocks(3, torch.float32))
    assert stored == keys[:2]


def test_known_hashes_are_touched_not_copied():
    tier = HostTier(4, BLOCK, torch.float32, pin_memory=False, policy=A2CR())
    keys, data = hashes(2), blocks(2, torch.float32)
    tier.store(keys, data)
    stored, _ = tier.store(keys, torch.zeros_like(data))
    assert stored == []
    assert torch.equal(tier.load(keys)[0], data)


def test_bad_input_raises():
    tier = HostTier(4, BLOCK, torch.float32, pin_memory=False)
    with pytest.raises(ValueError):
        tier.store(hashes(2), blocks(3, torch.float32))
    with pytest.raises(ValueError):
        tier.store(hashes(2), blocks(2, torch.float16))
    with pytest.raises(KeyError):
        tier.load(hashes(1))


def test_discard_frees_the_slot():
    tier = HostTier(1, BLOCK, torch.float32, pin_memory=False)
    keys = hashes(2)
    tier.store(keys[:1], blocks(1, torch.float32))
    tier.discard(keys[0])
    assert tier.store(keys[1:], blocks(1, torch.float32))[0] == keys[1:] and tier.stats.evictions == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batched", [False, True])
def test_cuda_round_trip_on_the_copy_stream(batched):
    from wicore.ops.transfer import batch_copier

    if batched:
        pytest.importorskip("cuda.bindings")
    copier = batch_copier(torch.device("cuda")) if batched else None
    assert (copier is not None) == batched  # with cuda-python and a CUDA >= 12.8 driver
    tier = HostTier(16, BLOCK, torch.bfloat16, copier=copier)
    assert tier.pool.is_pinned() and tier.memory.registered
    keys, data = hashes(8), blocks(8).cuda()
    stored, transfer = tier.store(keys, data * 1)  # a temporary: kept alive by record_stream
    out, transfer = tier.load(keys[::-1], "cuda")
    transfer.wait()
    assert torch.equal(out, data.flip(0))
    tier.read(keys[0])  # a CPU reader waits for its store
    assert torch.equal(tier.read(keys[0]), data[0].cpu())
    stored, _ = tier.store(hashes(3, salt="more"), data[[5, 1, 6]])  # slots 8, 9, 10: one run
    assert torch.equal(tier.load(stored, "cpu")[0], data[[5, 1, 6]].cpu())
    tier.close()


def test_copies_coalesce_runs_of_consecutive_slots():
    from wicore.engines.kvcache.host_tier import _runs

    # (index in the batch, slot) -> (index, slot, count): one copy per run
    assert _runs([(0, 5), (1, 6), (2, 7), (3, 2), (5, 3)]) == [(0, 5, 3), (3, 2, 1), (5, 3, 1)]
    assert _runs([]) == []
