"""Options of the fast engine: validated, defaults resolved per device."""

from __future__ import annotations

import pytest

from wicore.engines.fast.options import FastOptions
from wicore.errors import ConfigError


def test_defaults():
    options = FastOptions.parse({})
    assert options.block_size == 16 and options.cuda_graphs and not options.compile_vision
    assert options.model_len(131_072) == 8192 and options.model_len(4096) == 4096
    assert options.prefill_tokens(8192) == 16384
    assert options.graph_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert options.graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert options.vision_batch(cuda=True) == 32 and options.vision_batch(cuda=False) == 8
    assert options.paged_suffix(cuda=True) == 128 and options.paged_suffix(cuda=False) == 0
    assert options.prefill_graph_sizes(16384)[:3] == [64, 128, 256] and options.prefill_graph_sizes(16384)[-1] == 2048
    assert options.prefill_graph_sizes(1000)[-1] == 896  # none above the prefill budget
    assert options.intra_op_threads(cuda=True) == 1 and options.intra_op_threads(cuda=False) is None


def test_explicit_values():
    options = FastOptions.parse({"block_size": 32, "graph_batch_sizes": [8, 1, 4], "num_kv_blocks": 100})
    assert options.graph_sizes(256) == [1, 4, 8] and options.num_kv_blocks == 100
    options = FastOptions.parse({"graph_prefill_tokens": [512, 64], "paged_prefill_tokens": 0})
    assert options.prefill_graph_sizes(16384) == [64, 512] and options.paged_suffix(cuda=True) == 0
    assert FastOptions.parse({"torch_threads": 4}).intra_op_threads(cuda=True) == 4


@pytest.mark.parametrize(
    "options",
    [
        {"block_sise": 16},
        {"block_size": 12},
        {"block_size": True},
        {"gpu_memory_utilization": 1.5},
        {"cuda_graphs": "yes"},
        {"graph_batch_sizes": []},
        {"graph_batch_sizes": [0, 4]},
        {"graph_prefill_tokens": [0]},
        {"paged_prefill_tokens": -1},
        {"vision_batch_size": 0},
        {"preprocess_threads": -1},
        {"torch_threads": 0},
        {"prefix_cache": 1},
        {"host_cache_bytes": -1},
        {"disk_cache_bytes": 0},
        {"cache_policy": "fifo"},
        {"disk_cache_dir": ""},
        {"disk_cache_dir": "/tmp/kv", "host_cache_bytes": 0},
        {"disk_cache_dir": "/tmp/kv", "prefix_cache": False},
    ],
)
def test_bad_options_raise(options):
    with pytest.raises(ConfigError):
        FastOptions.parse(options)


def test_lengths_must_fit_the_model():
    with pytest.raises(ConfigError):
        FastOptions.parse({"max_model_len": 5000}).model_len(4096)
    with pytest.raises(ConfigError):
        FastOptions.parse({"max_prefill_tokens": 100}).prefill_tokens(4096)


def test_cache_defaults():
    options = FastOptions.parse({})
    assert options.prefix_cache and options.cache_policy == "a2cr" and options.disk_cache_dir is None
    assert options.host_bytes(cuda=True) == 4 * 2**30 and options.host_bytes(cuda=False) == 0
    assert FastOptions.parse({"prefix_cache": False}).host_bytes(cuda=True) == 0
    assert FastOptions.parse({"host_cache_bytes": 4096}).host_bytes(cuda=False) == 4096
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        FastOptions.parse({"disk_cache_dir": "/tmp/kv"}).host_bytes(cuda=False)
