"""The fast engine with an FP8 KV cache (engine option kv_cache_dtype=fp8): e4m3 pages that every
path reads alike, so the prefix cache's tiers give caching off's tokens; the cost in tokens
against the model dtype's, on the tiny random model and on the trained demo captioner.

Every prefill here attends over its pages (`paged_prefill_tokens` 128, as on CUDA), so caching
off reads the same FP8 K/V as a cached follow-up does.
"""

from __future__ import annotations

import pytest
import torch

from tests.fast_requests import mismatches, one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import fp8_gpu
from tests.test_fast_fp8 import democap
from tests.test_fast_prefix_parity import all_requests, engine, mixed_requests, model_dir, vqa  # noqa: F401
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.errors import ConfigError
from wicore.ops.attention import KV_FP8

pytestmark = pytest.mark.slow
FP8_KV = {"kv_cache_dtype": "fp8"}


@pytest.fixture(scope="module")
def caching_off(model_dir):  # noqa: F811
    fast = engine(model_dir, prefix_cache=False, **FP8_KV)
    out = {c.id: c for c in fast.generate(all_requests())}
    fast.close()
    return out


def check(out, caching_off):
    assert all(c.ok for c in out)
    assert mismatches(out, [caching_off[c.id] for c in out]) == []


def test_the_pages_are_e4m3_at_half_the_bytes_and_the_tokens_mostly_the_model_dtypes(model_dir, caching_off):  # noqa: F811
    model = engine(model_dir, prefix_cache=False)
    fp8 = engine(model_dir, prefix_cache=False, **FP8_KV)
    assert fp8.runner.cache.layer(0)[1].dtype == KV_FP8 and fp8.runner.cache.tensor.dtype == torch.uint8
    assert fp8.runner.cache.tensor.nbytes * 4 == model.runner.cache.tensor.nbytes  # float32 -> 1 byte
    differ = mismatches(list(caching_off.values()), model.generate(all_requests()))
    assert len(differ) <= 3, differ  # 1 of 18 measured (random weights: near-tied logits)
    model.close()
    fp8.close()


def test_hits_in_the_gpu_pool_give_caching_offs_tokens(model_dir, caching_off):  # noqa: F811
    fast = engine(model_dir, **FP8_KV)
    check(fast.generate(all_requests()), caching_off)
    check(fast.generate(all_requests()), caching_off)
    assert fast.stats()["cache"]["gpu"]["hits"] > 0 and fast.stats()["cached_prompt_tokens"] > 0


def test_blocks_through_the_host_tier_and_the_disk_come_back_as_they_left(model_dir, caching_off, tmp_path):  # noqa: F811
    requests = mixed_requests()[:4] + vqa()
    small = engine(model_dir, num_kv_blocks=60, host_cache_bytes=2**20, **FP8_KV)
    check(small.generate(requests), caching_off)
    check(small.generate(requests), caching_off)
    assert small.stats()["cache"]["host"]["hits"] > 0
    small.close()

    options = {"num_kv_blocks": 60, "host_cache_bytes": 4 * 1024, "disk_cache_dir": str(tmp_path / "kv"), **FP8_KV}
    first = engine(model_dir, **options)  # a host tier of 8 FP8 blocks: most go on to the disk
    check(first.generate(requests), caching_off)
    first.tiers.disk.flush()
    first.close()
    second = engine(model_dir, **options)
    check(second.generate(requests[:4]), caching_off)
    assert second.stats()["cache"]["disk"]["hits"] > 0
    second.close()


def test_a_dense_prefill_reads_its_cached_prefix_from_the_fp8_pages(model_dir, caching_off):  # noqa: F811
    # The follow-ups' prefixes gathered from the pages beside their fresh suffixes.
    fast = engine(model_dir, paged_prefill_tokens=0, **FP8_KV)
    out = fast.generate(all_requests())
    assert all(c.ok for c in out) and fast.stats()["cached_prompt_tokens"] > 0
    assert len(mismatches(out, [caching_off[c.id] for c in out])) <= 1  # 0 of 18 measured


def test_the_kv_cache_keys_differ_between_kv_dtypes(model_dir):  # noqa: F811
    """A shared disk tier must not hand model-dtype blocks to an engine with FP8 pages."""
    keys = []
    for dtype in ("model", "fp8"):
        fast = engine(model_dir, kv_cache_dtype=dtype)
        keys.append(fast.keyer.model_id)
        fast.close()
    assert keys[0] != keys[1]


def test_the_demo_captioner_keeps_its_captions_with_fp8_pages():
    (model, right, _), (fp8, right_fp8, _) = democap(FastOptions(), 48), democap(FastOptions(**FP8_KV), 48)
    assert sum(a == b for a, b in zip(model, fp8)) >= 46  # 48 of 48 measured
    assert right_fp8 >= right - 1


def test_unknown_kv_dtypes_are_one_line_errors():
    with pytest.raises(ConfigError) as error:
        FastOptions.parse({"kv_cache_dtype": "fp4"})
    assert "\n" not in str(error.value) and "kv_cache_dtype" in str(error.value)


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
def test_cuda_fp8_pages_through_graphs_keep_the_captions():
    """The product path on the GPU (compiled layers, decode and short-prefill graphs, the Triton
    kernel over e4m3 pages): the demo captioner's captions as with bf16 pages."""
    runs = {}
    for kv_dtype in ("model", "fp8"):
        options = FastOptions(kv_cache_dtype=kv_dtype, num_kv_blocks=4096, compile_text=True, compile_vision=False)
        runs[kv_dtype] = democap(options, 64, device="cuda")
    assert sum(a == b for a, b in zip(runs["model"][0], runs["fp8"][0])) >= 60
    assert runs["fp8"][1] >= runs["model"][1] - 2 and runs["fp8"][2]["graph_replays"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fp8_gpu(), reason="needs a CUDA GPU below compute capability 8.9")
def test_cuda_fp8_pages_below_ada_are_a_one_line_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="use kv_cache_dtype=model"):
        FastEngine(EngineConfig(str(tiny_model_dir), device="cuda", options=FastOptions(**FP8_KV)))
