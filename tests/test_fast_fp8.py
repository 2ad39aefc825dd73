"""FP8 GEMMs in the fast engine (`gemm_dtype = "fp8"`, engines/fast/model/fp8.py): which layers are
quantized, that the bf16 weights go, how close the model stays to bf16, and the refusals. On the
CPU the engine runs FP8 only when asked to (`fp8_anywhere`: torch's CPU scaled matmul); the GPU
tests run it as users do."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig

from tests.fast_requests import one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import fp8_gpu
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.fast.model import fp8
from wicore.engines.fast.model.loader import load_gemma3
from wicore.engines.fast.model.vision_tower import SiglipLayer, VisionTower
from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.sampler import Sampler
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.options import FastOptions
from wicore.errors import ConfigError
from wicore.models import DEMOCAP_DIR
from wicore.models.democap import evaluate
from wicore.ops.attention import pack_layout
from wicore.ops.fp8 import FP8Weight, fp8_linear

CPU = torch.device("cpu")
FP8 = FastOptions(gemm_dtype="fp8")


@pytest.fixture(scope="module")
def bf16(tiny_model_dir):
    return load_gemma3(tiny_model_dir, CPU, "bfloat16")


@pytest.fixture(scope="module")
def quantized(tiny_model_dir):
    parts = load_gemma3(tiny_model_dir, CPU, "bfloat16")
    return parts, fp8.quantize(parts)


def test_every_dense_layer_is_quantized_and_the_rest_stays(bf16, quantized):
    parts, report = quantized
    layers = len(parts.encoder.vision_tower.layers) + len(parts.decoder.layers)
    assert report.quantized == 4 * layers and report.skipped == []  # vision: qkv, out, fc1, fc2; text: 4 fused
    attention = parts.encoder.vision_tower.layers[0].self_attn
    assert isinstance(attention.qkv_proj, fp8.FP8Linear) and not hasattr(attention, "q_proj")
    assert isinstance(parts.encoder.vision_tower.layers[0].mlp, fp8.FP8GeluMLP)  # GELU-tanh: fused
    assert attention.qkv_proj.weight.dtype == torch.float8_e4m3fn and attention.qkv_proj.bias.dtype == torch.bfloat16
    layer = parts.decoder.layers[0]
    assert all(isinstance(getattr(layer, name), FP8Weight) for name in ("qkv_weight", "o_weight", "down_weight"))
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert parts.decoder.embed_tokens.weight.dtype == torch.bfloat16  # and so the tied lm_head
    assert parts.encoder.multi_modal_projector.mm_input_projection_weight.dtype == torch.bfloat16
    assert parts.encoder.vision_tower.patch_embedding.weight.dtype == torch.bfloat16
    assert report.bytes_after < report.bytes_before == fp8.weight_bytes(bf16)


def test_the_fp8_tower_embeds_patches_by_gemm_as_the_conv_does(bf16, quantized):
    parts, _ = quantized
    assert parts.encoder.vision_tower.patch_embedding.as_gemm
    assert not bf16.encoder.vision_tower.patch_embedding.as_gemm  # bf16 runs transformers' conv
    conv = copy.deepcopy(bf16.encoder.vision_tower.patch_embedding).float()
    pixels = torch.randn(2, conv.in_channels, 4 * conv.kernel_size[0], 4 * conv.kernel_size[0])
    want = conv(pixels)
    conv.as_gemm = True
    got = conv(pixels)
    assert got.shape == want.shape == (2, 16, conv.out_channels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_bf16_weights_are_freed(tiny_model_dir):
    parts = load_gemma3(tiny_model_dir, CPU, "bfloat16")
    originals = [
        weakref.ref(parts.decoder.layers[0].qkv_weight),
        weakref.ref(parts.decoder.layers[1].down_weight),
        weakref.ref(parts.encoder.vision_tower.layers[0].self_attn.q_proj.weight),
        weakref.ref(parts.encoder.vision_tower.layers[1].mlp.fc2.weight),
    ]
    fp8.quantize(parts)
    gc.collect()
    assert [ref() for ref in originals] == [None] * 4


def prefill_logits(parts, ids: torch.Tensor, image_at: int, pixels: torch.Tensor) -> torch.Tensor:
    """Logits [L, vocab] at every position of one prompt whose image soft tokens start at `image_at`."""
    text = parts.config.text_config
    layout = KVLayout.build(text, block_size=16, max_model_len=256)
    sampler = Sampler(text.vocab_size, frozenset(), "cpu")
    runner = ModelRunner(parts, layout, max_rows=1, sampler=sampler, device="cpu", dtype=torch.bfloat16)
    runner.allocate_cache(2)
    n, image = len(ids), torch.arange(image_at, image_at + parts.tokens_per_image)
    ids = ids.clone()
    ids[image] = parts.image_token_id
    groups = torch.full((1, n), -1)
    groups[0, image] = 0
    with torch.inference_mode():
        embeds = parts.encoder(pixels.to(torch.bfloat16)).flatten(0, 1)
        return runner.prefill_logits(
            ids=ids, positions=torch.arange(n), slots=torch.zeros(len(layout.groups), n, dtype=torch.long),
            image_rows=image, image_groups=groups, last=torch.arange(n), layout=pack_layout([n], "cpu"),
            image_embeds=embeds,
        ).float()  # fmt: skip


def test_the_fused_mlp_computes_what_the_unfused_layers_do():
    """FP8GeluMLP (fc1's bias and the GELU in fc2's input quantization) against the same chain
    written with fp8_linear over its weights: bit for bit on the CPU, where both run torch."""
    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4)
    layer = SiglipLayer(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        fp8.quantize_vision_layer(layer, fp8.FP8Report(), "fused")
    mlp = layer.mlp
    assert isinstance(mlp, fp8.FP8GeluMLP)
    fc1, fc2 = FP8Weight(mlp.fc1.weight, mlp.fc1.scale), FP8Weight(mlp.fc2.weight, mlp.fc2.scale)
    x = torch.randn(3, 10, 64).to(torch.bfloat16)
    with torch.inference_mode():
        hidden = F.gelu(fp8_linear(x, fc1, mlp.fc1.bias), approximate="tanh")
        assert torch.equal(mlp(x), fp8_linear(hidden, fc2, mlp.fc2.bias, bias_in_epilogue=True))


def test_the_fused_norms_compute_what_the_unfused_layers_do():
    """FP8SiglipLayer (each norm in the pass that quantizes the next GEMM's input, the residual add
    before it, the MLP's output left for the next layer) against the SigLIP layers over the same
    FP8 modules: bit for bit on the CPU, one layer and a tower of three."""
    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
    )
    fused, unfused = (VisionTower(config).to(torch.bfloat16).eval() for _ in range(2))
    unfused.load_state_dict(fused.state_dict())
    with torch.no_grad():
        fp8.quantize_vision(fused, fp8.FP8Report())
        for layer in unfused.layers:
            assert fp8.quantize_vision_layer(layer, fp8.FP8Report(), "unfused", fuse_norms=False) is layer
    assert all(isinstance(layer, fp8.FP8SiglipLayer) for layer in fused.layers)
    x, pixels = torch.randn(2, 16, 64).to(torch.bfloat16), torch.randn(2, 3, 32, 32).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(fused.layers[0](x), unfused.layers[0](x))
        assert torch.equal(fused(pixels), unfused(pixels))


def test_fp8_logits_stay_close_to_bf16(bf16, quantized):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 500, (40,), generator=generator)
    pixels = torch.randn(1, 3, 64, 64, generator=generator)
    want = prefill_logits(bf16, ids, 3, pixels)
    got = prefill_logits(quantized[0], ids, 3, pixels)
    cosine = F.cosine_similarity(got, want, dim=-1)  # per position; hidden 64 averages little rounding away
    assert cosine.mean() > 0.99 and cosine.min() > 0.98
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.7  # random weights: many near-ties (0.8 here)
    with torch.inference_mode():
        images = F.cosine_similarity(quantized[0].encoder(pixels.bfloat16()), bf16.encoder(pixels.bfloat16()), dim=-1)
    assert images.float().min() > 0.99


def test_dims_that_are_not_multiples_of_16_stay_and_are_named():
    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=64, intermediate_size=120, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    tower = VisionTower(config).to(torch.bfloat16).eval()
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = tower(pixels)
    report = fp8.FP8Report()
    with torch.no_grad():
        fp8.quantize_vision(tower, report)
    assert report.quantized == 4 and report.skipped == ["vision.0.fc1", "vision.0.fc2", "vision.1.fc1", "vision.1.fc2"]
    assert isinstance(tower.layers[0].mlp.fc1, torch.nn.Linear)
    with torch.inference_mode():
        assert F.cosine_similarity(tower(pixels), want, dim=-1).float().min() > 0.99


def democap(options: FastOptions, count: int, **config) -> tuple[list[list[int]], int, dict]:
    """Tokens of the demo captioner's greedy captions of `count` evaluation images, how many are
    exactly right, and the engine's stats."""
    engine = FastEngine(EngineConfig(str(DEMOCAP_DIR), dtype="bfloat16", max_batch_size=count, options=options, **config),
                        fp8_anywhere=True)  # fmt: skip
    samples = evaluate.main_samples(count, seed=1000)
    completions = evaluate.engine_captions(engine, samples)
    stats = engine.stats()
    engine.close()
    return [c.token_ids for c in completions], evaluate.score_completions(samples, completions).correct, stats


@pytest.mark.slow
def test_the_demo_captioner_keeps_its_captions_in_fp8():
    (bf16, right, _), (quantized, right_fp8, stats) = democap(FastOptions(), 48), democap(FP8, 48)
    assert stats["fp8_linears"] == 24 and stats["fp8_skipped"] == []  # its dims are all multiples of 16
    assert sum(a == b for a, b in zip(bf16, quantized)) >= 44  # 47 of 48 measured
    assert right_fp8 >= right - 2


def test_fp8_on_the_cpu_is_a_one_line_error_before_loading(tiny_model_dir):
    with pytest.raises(ConfigError) as error:
        FastEngine(EngineConfig(str(tiny_model_dir), dtype="bfloat16", options=FP8))
    message = str(error.value)
    assert "\n" not in message and "the device is cpu" in message and "use --dtype bfloat16" in message


def test_the_kv_cache_keys_differ_between_precisions(tiny_model_dir):
    """FP8 GEMMs write other K/V: a shared disk tier must not hand bf16 blocks to an FP8 engine."""
    keys = {}
    for options in (FastOptions(), FP8):
        engine = FastEngine(EngineConfig(str(tiny_model_dir), dtype="bfloat16", options=options), fp8_anywhere=True)
        keys[options.gemm_dtype] = engine.keyer.model_id
        engine.close()
    assert keys["model"] != keys["fp8"]


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
def test_cuda_fp8_engine_compiled_and_graphed_keeps_the_captions():
    """The product path on the GPU: compiled tower and layers, decode graphs, FP8 GEMMs (the
    tower compiled in inductor's default mode: its default, max-autotune, tunes for minutes)."""
    runs = {}
    for gemm_dtype in ("model", "fp8"):
        options = FastOptions(
            gemm_dtype=gemm_dtype, num_kv_blocks=4096, compile_vision=True, compile_text=True,
            vision_compile_mode="default",
        )  # fmt: skip
        runs[gemm_dtype] = democap(options, 64, device="cuda")
    assert sum(a == b for a, b in zip(runs["model"][0], runs["fp8"][0])) >= 56
    assert runs["fp8"][1] >= runs["model"][1] - 3 and runs["fp8"][2]["graph_replays"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
def test_cuda_fp8_needs_bfloat16_activations(tiny_model_dir):
    with pytest.raises(ConfigError, match="not float16: use --dtype fp8"):
        FastEngine(EngineConfig(str(tiny_model_dir), device="cuda", dtype="float16", options=FP8))
