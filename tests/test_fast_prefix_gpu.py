"""The prefix cache's CUDA paths (copy stream, events, pinned tiers, restore probe) against the
reference engine on the GPU. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.fast_requests import mismatches, mixed_requests
from tests.test_fast_prefix_parity import several_images, vqa
from wicore.bench.restore_probe import h2d_bandwidth, restore_bandwidths
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


def requests():
    return mixed_requests()[:4] + vqa() + several_images()


@pytest.fixture(scope="module")
def expected(model_dir):
    reference = ReferenceEngine(EngineConfig(str(model_dir), device="cuda", max_batch_size=16))
    return {c.id: c for c in reference.generate(requests())}


def engine(model_dir, **options):
    options = {"block_size": 4, "num_kv_blocks": 60, "host_cache_bytes": 2**20, **options}
    return FastEngine(EngineConfig(str(model_dir), device="cuda", max_batch_size=4, options=FastOptions(**options)))


@pytest.mark.parametrize("paged,batched", [(None, None), (0, None), (None, False)])
def test_cuda_hits_from_gpu_host_and_disk_match_reference(model_dir, expected, tmp_path, paged, batched):
    # Short prefills over their pages in CUDA graphs (the default), or all through the dense prefill;
    # KV blocks moved by batched copies (the default where cuda-python has them) or per run of slots.
    options = {"host_cache_bytes": 16 * 2048, "disk_cache_dir": str(tmp_path), "paged_prefill_tokens": paged}
    fast = engine(model_dir, **options, batched_copies=batched)
    for _ in range(3):
        out = fast.generate(requests())
        assert mismatches(out, [expected[c.id] for c in out]) == []
        fast.tiers.disk.flush()
    stats = fast.stats()
    cache = stats["cache"]
    assert cache["gpu"]["hits"] > 0 and cache["host"]["hits"] > 0 and cache["gpu"]["bytes_in"] > 0
    assert cache["disk"]["bytes_in"] > 0
    assert (stats["prefill_graph_replays"] > 0) == (paged is None)
    fast.close()


def test_cuda_cache_steps_never_synchronize_implicitly(model_dir, expected):
    fast = engine(model_dir)
    fast.generate(requests())  # fills the GPU pool and the host tier
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fast.generate(requests())  # hits, evictions, copies down and restores
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [c.error for c in out if not c.ok] == []
    assert mismatches(out, [expected[c.id] for c in out]) == []


def test_cuda_restore_probe(model_dir):
    fast = engine(model_dir, num_kv_blocks=4096)
    rates, h2d = restore_bandwidths(fast, 1024), h2d_bandwidth(fast, 1024 * fast.tiers.block_bytes)
    assert rates["per_run"] > 0 and h2d > 0
    assert rates["batched"] is not None or importlib.util.find_spec("cuda.bindings") is None
    for way, rate in rates.items():
        if rate is not None:
            print(f"restore ({way}) {rate / 1e9:.2f} GB/s, pinned h2d {h2d / 1e9:.2f} GB/s, ratio {rate / h2d:.2f}")
    fast.close()
