"""The restore-bandwidth probes on CPU: they borrow free pages and give them back, alone and on a
fast engine's pool."""

from __future__ import annotations

import torch

from tests.test_kvcache_tiers import DIM, HEADS, kv_cache
from wicore.bench.restore_probe import h2d_bandwidth, measure_h2d, measure_restores, restore_bandwidths
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.options import FastOptions


def test_restore_probe_borrows_free_pages():
    cache = kv_cache()
    blocks = BlockManager(32)
    shape = cache.layout.block_shape(HEADS, DIM)
    rates = measure_restores(cache, blocks, shape, 4, repeats=2)
    assert rates["per_run"] > 0 and rates["batched"] is None  # no batched copy on CPU
    assert blocks.num_free == 31
    assert measure_h2d(4096, torch.device("cpu")) > 0


def test_probes_run_on_an_idle_fast_engine(tiny_model_dir):
    engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=2, options=FastOptions(num_kv_blocks=64)))
    free = engine.blocks.num_free
    rates = restore_bandwidths(engine, 4, repeats=1)
    assert rates["per_run"] > 0 and rates["batched"] is None and engine.blocks.num_free == free
    assert h2d_bandwidth(engine, 4096, repeats=1) > 0
    engine.close()
