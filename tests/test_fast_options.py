"""Options of the fast engine: validated, defaults resolved once per device."""

from __future__ import annotations

import dataclasses

import pytest

from wicore.engines.options import FastOptions
from wicore.errors import ConfigError


def resolve(options: dict | None = None, *, cuda: bool, model_limit: int = 131_072, batch: int = 64, **kwargs):
    return FastOptions.parse(options or {}).resolve(cuda=cuda, model_limit=model_limit, max_batch_size=batch, **kwargs)


def test_defaults():
    options = FastOptions.parse({})
    assert options.block_size == 16 and options.cuda_graphs and not options.compile_vision
    assert resolve(cuda=True).max_model_len == 8192 and resolve(cuda=True, model_limit=4096).max_model_len == 4096
    assert resolve(cuda=True, model_limit=8192).max_prefill_tokens == 16384
    assert resolve(cuda=True, batch=64).graph_batch_sizes == (1, 2, 4, 8, 16, 32, 48, 64)
    assert resolve(cuda=True, batch=40).graph_batch_sizes == (1, 2, 4, 8, 16, 32, 40)
    assert resolve(cuda=True).vision_batch_size == 8 == resolve(cuda=False).vision_batch_size
    assert resolve(cuda=True).vision_batches_queued == 1
    assert resolve(cuda=True).paged_prefill_tokens == 128 and resolve(cuda=False).paged_prefill_tokens == 0
    prefill_graphs = resolve(cuda=True).graph_prefill_tokens
    assert prefill_graphs[:3] == (64, 128, 256) and prefill_graphs[-1] == 2048
    capped = resolve({"max_prefill_tokens": 1000, "max_model_len": 1000}, cuda=True)
    assert capped.graph_prefill_tokens[-1] == 896  # none above the prefill budget
    assert resolve(cuda=True).torch_threads == 1 and resolve(cuda=False).torch_threads is None


def test_resolved_defaults_on_cpu_and_cuda():
    """Every device-dependent default, fixed once; resolving for CUDA needs no GPU."""
    cpu, cuda = resolve(cuda=False, batch=8), resolve(cuda=True, batch=8)
    assert (cpu.compile_vision, cpu.compile_text, cpu.cuda_graphs) == (False, False, False)
    assert (cuda.compile_vision, cuda.compile_text, cuda.cuda_graphs) == (True, True, True)
    assert cpu.graph_batch_sizes == cpu.graph_prefill_tokens == () and cuda.graph_batch_sizes == (1, 2, 4, 8)
    assert (cpu.dense_prefill_graphs, cuda.dense_prefill_graphs) == (0, 4)  # graphs are CUDA's
    assert (cpu.vision_graph, cuda.vision_graph) == (False, True)
    assert not resolve({"vision_graph": False}, cuda=True).vision_graph
    assert not resolve({"cuda_graphs": False}, cuda=True).vision_graph  # with the other graphs only
    assert (cuda.decode_interval_s, resolve({"decode_interval_ms": 100}, cuda=True).decode_interval_s) == (0, 0.1)
    assert (cpu.preprocess_threads, cuda.preprocess_threads) == (0, 8)
    assert (cpu.vision_cache_bytes, cuda.vision_cache_bytes) == (64 * 2**20, 2 * 2**30)
    assert (cpu.host_cache_bytes, cuda.host_cache_bytes) == (0, 4 * 2**30)
    assert (cpu.batched_copies, cuda.batched_copies) == (False, False)  # per-run copies measured faster
    assert resolve({"batched_copies": True}, cuda=True).batched_copies
    assert not resolve({"batched_copies": False}, cuda=True).batched_copies
    assert not resolve({"batched_copies": True}, cuda=False).batched_copies  # CUDA copies only
    assert cpu.max_model_len == cuda.max_model_len == 8192 and cpu.block_size == cuda.block_size == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        cuda.block_size = 32  # type: ignore[misc]


def test_no_cache_turns_every_cache_off():
    resolved = resolve({"host_cache_bytes": 4096, "disk_cache_dir": "/tmp/kv"}, cuda=True, cache=False)
    assert not resolved.prefix_cache and resolved.host_cache_bytes == 0 and resolved.disk_cache_dir is None
    assert resolved.vision_cache_bytes == 0


def test_explicit_values():
    resolved = resolve({"block_size": 32, "graph_batch_sizes": [8, 1, 4], "num_kv_blocks": 100}, cuda=True, batch=256)
    assert resolved.graph_batch_sizes == (1, 4, 8) and resolved.num_kv_blocks == 100
    resolved = resolve({"graph_prefill_tokens": [512, 64], "paged_prefill_tokens": 0}, cuda=True)
    assert resolved.graph_prefill_tokens == (64, 512) and resolved.paged_prefill_tokens == 0
    assert resolve({"torch_threads": 4}, cuda=True).torch_threads == 4
    assert not resolve({"cuda_graphs": False}, cuda=True).cuda_graphs
    assert resolve({"cuda_graphs": False}, cuda=True).dense_prefill_graphs == 0
    assert resolve({"dense_prefill_graphs": 0}, cuda=True).dense_prefill_graphs == 0
    assert resolve(cuda=True).vision_compile_mode == "max-autotune-no-cudagraphs"
    assert resolve({"gemm_dtype": "fp8"}, cuda=True).vision_compile_mode == "max-autotune-cublas"
    assert resolve({"gemm_dtype": "fp8", "vision_compile_mode": "default"}, cuda=True).vision_compile_mode == "default"
    assert resolve({"vision_compile_mode": "default"}, cuda=True).vision_compile_mode == "default"


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
        {"gemm_dtype": "int8"},
        {"gemm_dtype": "FP8"},
        {"gemm_dtype": True},
        {"vision_compile_mode": "max-autotune"},  # CUDA graphs inside the tower: not offered
        {"disk_cache_dir": ""},
        {"disk_cache_dir": "/tmp/kv", "host_cache_bytes": 0},
        {"disk_cache_dir": "/tmp/kv", "prefix_cache": False},
    ],
)
def test_bad_options_raise(options):
    with pytest.raises(ConfigError) as error:
        FastOptions.parse(options)
    message = str(error.value)
    assert "\n" not in message and ("disk_cache_dir" in message or next(iter(options)) in message)


def test_lengths_must_fit_the_model():
    with pytest.raises(ConfigError, match="max_model_len"):
        resolve({"max_model_len": 5000}, cuda=True, model_limit=4096)
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        resolve({"max_prefill_tokens": 100}, cuda=True, model_limit=4096)


def test_cache_defaults():
    options = FastOptions.parse({})
    assert options.prefix_cache and options.cache_policy == "a2cr" and options.disk_cache_dir is None
    assert resolve(cuda=True).host_cache_bytes == 4 * 2**30 and resolve(cuda=False).host_cache_bytes == 0
    assert resolve({"prefix_cache": False}, cuda=True).host_cache_bytes == 0
    assert resolve({"host_cache_bytes": 4096}, cuda=False).host_cache_bytes == 4096
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        resolve({"disk_cache_dir": "/tmp/kv"}, cuda=False)


def test_gemm_dtype():
    assert FastOptions.parse({}).gemm_dtype == "model" and resolve(cuda=True).gemm_dtype == "model"
    assert resolve({"gemm_dtype": "fp8"}, cuda=True).gemm_dtype == "fp8"  # the engine checks the device
