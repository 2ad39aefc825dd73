"""Loading the fast engine's model tensor by tensor (engines/fast/model/loader.py): the peak
of CPU allocations during a load stays within the loaded model plus its largest layer (torch's
profiler counts every allocation of the CPU allocator), seeded weights equal the reference
engine's, FP8 quantized in blocks equals quantized whole; and the fit check before the load."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from tests.fast_requests import one_torch_thread  # noqa: F401 (fixture)
from tests.model_shapes import MID_SIZE, reshaped
from wicore.engines.base import EngineConfig
from wicore.engines.checkpoint import load_hf_model
from wicore.engines.fast import FastEngine
from wicore.engines.fast.fit import ModelDoesNotFit, model_needs
from wicore.engines.fast.model import fp8
from wicore.engines.fast.model.loader import FP8Plan, load_gemma3
from wicore.engines.fast.model.text_decoder import TextDecoder
from wicore.engines.fast.model.vision_tower import ImageEncoder
from wicore.engines.options import FastOptions
from wicore.models.gemma3 import gemma3_config, write_seeded_weights
from wicore.ops.fp8 import quantize_weight

CPU = torch.device("cpu")
GIB = 2**30


@pytest.fixture(scope="module")
def mid_seeded(tiny_model_dir, tmp_path_factory):
    return reshaped(tiny_model_dir, tmp_path_factory.mktemp("models") / "mid-seeded", MID_SIZE, weights=False)


@pytest.fixture(scope="module")
def mid_safetensors(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "mid-bf16"
    return reshaped(tiny_model_dir, out, MID_SIZE, weights=True, dtype=torch.bfloat16)


def profiled_load(model_dir, dtype: str, plan: FP8Plan | None = None):
    """The loaded parts, the peak and the final bytes of CPU allocations made during the load.
    Not counted: the shards' mappings (safe_open maps each file copy-on-write through torch's
    `UntypedStorage.from_file`, which the profiler reports as an allocation of the file's size;
    its pages are the file's, and never the device's on a GPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        parts = load_gemma3(model_dir, CPU, dtype, fp8_plan=plan)
    shards = {file.stat().st_size for file in Path(model_dir).glob("*.safetensors")}
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and abs(e.nbytes()) not in shards
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return parts, peak, live


def largest_layer_bytes(model_dir, dtype: torch.dtype) -> int:
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        encoder, decoder = ImageEncoder(config), TextDecoder(config.text_config)
    layers = [*encoder.vision_tower.layers, *decoder.layers]
    return max(sum(p.numel() for p in layer.parameters()) for layer in layers) * dtype.itemsize


@pytest.mark.parametrize(
    ("model", "dtype"),
    [("tiny", "float32"), ("tiny", "bfloat16"), ("mid_seeded", "bfloat16"), ("mid_safetensors", "float32")],
)
def test_load_peak_is_the_model_plus_one_layer(model, dtype, request, tiny_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else request.getfixturevalue(model)
    parts, peak, final = profiled_load(model_dir, dtype)
    weights = fp8.weight_bytes(parts)
    assert final >= weights  # the profiler saw every weight's buffer allocated
    assert peak <= weights + largest_layer_bytes(model_dir, getattr(torch, dtype))
    assert parts.report["weight_bytes"] == weights and parts.report["load_s"] > 0


def test_fp8_load_never_holds_the_bf16_model(mid_seeded):
    parts, peak, _ = profiled_load(mid_seeded, "bfloat16", FP8Plan())
    weights = fp8.weight_bytes(parts)
    report = parts.report
    assert report["fp8_linears"] == 4 * (len(parts.decoder.layers) + len(parts.encoder.vision_tower.layers))
    assert report["weight_bytes_before_fp8"] > 1.7 * weights  # the dense weights are most of the model
    assert peak <= weights + largest_layer_bytes(mid_seeded, torch.bfloat16)


def test_fp8_load_equals_quantizing_the_loaded_model(tiny_model_dir):
    streamed = load_gemma3(tiny_model_dir, CPU, "bfloat16", fp8_plan=FP8Plan())
    whole = load_gemma3(tiny_model_dir, CPU, "bfloat16")
    fp8.quantize(whole)
    for ours, theirs in zip(streamed.decoder.layers, whole.decoder.layers, strict=True):
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            assert torch.equal(getattr(ours, name).data.view(torch.uint8), getattr(theirs, name).data.view(torch.uint8))
            assert torch.equal(getattr(ours, name).scale, getattr(theirs, name).scale)


def test_block_quantization_is_the_whole_tensors():
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    blocks, whole = fp8.quantize_in_blocks(weight), quantize_weight(weight)
    assert torch.equal(blocks.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(blocks.scale, whole.scale)


def test_seeded_weights_are_the_reference_engines(mid_seeded):
    ours = load_gemma3(mid_seeded, CPU, "float32")
    hf = load_hf_model(mid_seeded, "cpu", "float32")
    theirs = hf.model.language_model.layers[1]
    layer = ours.decoder.layers[1]
    fused = torch.cat([theirs.self_attn.q_proj.weight, theirs.self_attn.k_proj.weight, theirs.self_attn.v_proj.weight])
    assert torch.equal(layer.qkv_weight, fused)
    assert torch.equal(layer.self_attn.k_proj.weight, theirs.self_attn.k_proj.weight)  # a view of the fused one
    assert torch.equal(ours.decoder.embed_tokens.weight, hf.model.language_model.embed_tokens.weight)
    projector = hf.model.multi_modal_projector.mm_input_projection_weight
    assert torch.equal(ours.encoder.multi_modal_projector.mm_input_projection_weight, projector)
    assert 0.015 < layer.qkv_weight.std() < 0.025  # initializer_range 0.02


def test_ready_phases_in_stats_and_log(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="wicore.engines.fast"):
        engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=2, options=FastOptions(torch_threads=1)))
    stats = engine.stats()
    assert stats["ready_s"] >= stats["load_s"] + stats["compile_s"] + stats["kv_warm_up_s"] - 1e-3
    assert "graph_capture_s" not in stats  # no CUDA graphs on the CPU
    assert any(r.getMessage().startswith("engine ready: load ") for r in caplog.records)
    assert any(r.getMessage().startswith("weights loaded: ") for r in caplog.records)
    engine.close()


def test_a_model_that_does_not_fit_is_refused_before_loading(tiny_model_dir):
    config = EngineConfig(str(tiny_model_dir), options=FastOptions(memory_budget_bytes=100_000))
    with pytest.raises(ModelDoesNotFit) as refusal:
        FastEngine(config)
    line = str(refusal.value)
    assert line.startswith("the model does not fit: it needs ") and "\n" not in line
    assert "is available (memory_budget_bytes); try --dtype fp8 (weights " in line
    assert "a lower max_model_len (now 4096)" in line and "a lower --batch-size" in line


def test_the_27b_estimate():
    config = gemma3_config("gemma3-27b")
    options = FastOptions().resolve(cuda=True, model_limit=131_072, max_batch_size=384)
    bf16 = model_needs(config, EngineConfig("x", dtype="bfloat16"), options, fp8=False)
    fp8_needs = model_needs(config, EngineConfig("x", dtype="bfloat16"), options, fp8=True)
    assert 50 * GIB < bf16.weights < 52 * GIB  # 27.4 B parameters (its tied lm_head once)
    assert 26 * GIB < fp8_needs.weights < 27.5 * GIB  # the embeddings (1.4 B parameters) stay bf16
    assert bf16.total < 0.9 * 80 * GIB  # fits an H100's 90%


def test_the_estimate_counts_what_the_loader_allocates(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    options = FastOptions().resolve(cuda=False, model_limit=4096, max_batch_size=4)
    for dtype, plan in (("float32", None), ("bfloat16", FP8Plan())):
        parts = load_gemma3(tiny_model_dir, CPU, dtype, fp8_plan=plan)
        needs = model_needs(config, EngineConfig("x", dtype=dtype), options, fp8=plan is not None)
        assert needs.weights == fp8.weight_bytes(parts)


def test_loading_frees_nothing_it_keeps(tiny_model_dir):
    # Every parameter is a real tensor on the device (none left on the meta device).
    parts = load_gemma3(tiny_model_dir, CPU, "bfloat16")
    modules = nn.ModuleList([parts.encoder, parts.decoder])
    assert all(not p.is_meta and p.dtype == torch.bfloat16 for p in modules.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["mid_seeded", "mid_safetensors"])
@pytest.mark.parametrize("fp8_gemms", [False, True])
def test_gpu_load_peak_is_the_model_plus_one_layer(model, fp8_gemms, request):
    from tests.helpers import fp8_gpu

    if fp8_gemms and not fp8_gpu():
        pytest.skip("needs a CUDA GPU of compute capability 8.9+")
    model_dir = request.getfixturevalue(model)
    torch.cuda.empty_cache()
    parts = load_gemma3(model_dir, torch.device("cuda"), "bfloat16", fp8_plan=FP8Plan() if fp8_gemms else None)
    report = parts.report
    assert report["load_peak_bytes"] <= report["weight_bytes"] + largest_layer_bytes(model_dir, torch.bfloat16)
    del parts


def test_seeded_weights_written_as_shards_load_as_the_seeded_ones(tiny_model_dir, tmp_path):
    # `make-model gemma3-27b --weights` at toy size: bf16 shards under transformers' names and
    # their index; both engines read them, and they hold what a config-only load draws.
    written = tmp_path / "written"
    shutil.copytree(tiny_model_dir, written, ignore=shutil.ignore_patterns("*.safetensors"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    write_seeded_weights(written, config, seed=3, shard_bytes=200_000)
    assert len(list(written.glob("model-*.safetensors"))) > 1
    seeded = tmp_path / "seeded"
    shutil.copytree(tiny_model_dir, seeded, ignore=shutil.ignore_patterns("*.safetensors"))
    (seeded / "wicore_init.json").write_text('{"seed": 3}')
    ours, drawn = load_gemma3(written, CPU, "bfloat16"), load_gemma3(seeded, CPU, "bfloat16")
    for a, b in zip(ours.decoder.parameters(), drawn.decoder.parameters(), strict=True):
        assert torch.equal(a, b)
    hf = load_hf_model(written, "cpu", "bfloat16")
    assert torch.equal(hf.model.language_model.layers[0].mlp.up_proj.weight, ours.decoder.layers[0].mlp.up_proj.weight)
