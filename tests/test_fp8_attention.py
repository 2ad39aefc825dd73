"""The vision tower's attention in FP8 (ops/fp8_attention.py, engine option vision_attention_dtype):
the padding rule, the plain-torch definition against float32 attention, its scales from what
earlier calls saw, the FP8 layer that calls it, the engine's keys and refusals; on a Hopper GPU
with cuDNN's frontend, the CUDA op against that definition, inside a CUDA graph and under
torch.compile, and the demo captioner through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig

from tests.test_ops_fp8 import bitwise_equal
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.fast.model import fp8
from wicore.engines.fast.model.vision_tower import VisionTower
from wicore.engines.options import FastOptions
from wicore.errors import ConfigError
from wicore.ops.fp8_attention import (
    fp8_attention,
    fp8_attention_reference,
    new_seen,
    seen_maxima,
    unsupported_reason,
)
from wicore.ops.fp8_format import MARGIN, padded_head_dim

FP8_ATTENTION = FastOptions(gemm_dtype="fp8", vision_attention_dtype="fp8")


def float32_attention(qkv: torch.Tensor, batch: int, heads: int, head_dim: int) -> torch.Tensor:
    rows = qkv.shape[0]
    q, k, v = (
        t.float().view(batch, rows // batch, heads, head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
    )  # fmt: skip
    out = F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)
    return out.transpose(1, 2).reshape(rows, heads * head_dim)


def relative_error(pair: tuple[torch.Tensor, torch.Tensor], reference: torch.Tensor) -> float:
    values, scale = pair
    return float(((values.float() * scale) - reference).abs().mean() / reference.abs().mean())


def sample_qkv(batch: int, length: int, heads: int, head_dim: int, device="cpu", sharpness: float = 1.0):
    """q, k, v as a random-weight tower makes them (~N(0, 0.7)); q and k scaled by `sharpness`."""
    generator = torch.Generator(device=device).manual_seed(0)
    width = heads * head_dim
    qkv = torch.randn(batch * length, 3 * width, generator=generator, device=device) * 0.7
    qkv[:, : 2 * width] *= sharpness
    return qkv.to(torch.bfloat16)


def test_head_dims_are_padded_to_what_cudnn_runs():
    assert [padded_head_dim(d) for d in (32, 64, 72, 80, 128, 136, 256)] == [32, 64, 128, 80, 128, 144, 256]


def test_the_definition_stays_close_to_float32_attention():
    qkv = sample_qkv(2, 64, 4, 72)
    values, scale = fp8_attention(qkv, 2, 4, 72, new_seen("cpu"))  # the CPU runs the definition
    assert values.dtype == torch.float8_e4m3fn and values.shape == (128, 288) and scale.shape == (128, 1)
    error = relative_error((values, scale), float32_attention(qkv, 2, 4, 72))
    assert 0.005 < error < 0.08  # quantized (not exact), e4m3-sized


def part_amaxes(qkv: torch.Tensor) -> torch.Tensor:
    return qkv.float().view(qkv.shape[0], 3, -1).abs().amax(dim=(0, 2))


def holding(maxima: torch.Tensor) -> torch.Tensor:
    """A `seen` whose maxima are these."""
    seen = new_seen(maxima.device)
    seen[:, -1] = maxima
    return seen


def test_seen_keeps_the_largest_q_k_v_of_every_call_and_no_inf_or_nan():
    seen = new_seen("cpu")
    small, large = sample_qkv(2, 64, 4, 32) * 0.25, sample_qkv(2, 64, 4, 32)
    fp8_attention(small, 2, 4, 32, seen)
    assert torch.equal(seen_maxima(seen), part_amaxes(small))
    fp8_attention(large, 2, 4, 32, seen)
    fp8_attention(small, 2, 4, 32, seen)
    assert torch.equal(seen_maxima(seen), part_amaxes(large))
    broken = large * 2
    broken[0, 0], broken[1, 200] = float("inf"), float("nan")
    fp8_attention(broken, 2, 4, 32, seen)
    assert torch.equal(seen_maxima(seen), part_amaxes(broken.nan_to_num(0.0, posinf=0.0)))


def test_a_later_batch_scaled_by_what_earlier_ones_saw_gives_what_its_own_amax_gives():
    """Scales a power of two apart round the same mantissas: a batch at a quarter of what the
    layer saw gives a first call's e4m3 output, but for the values e4m3 then holds as subnormals."""
    qkv = sample_qkv(2, 64, 4, 32)
    alone = fp8_attention(qkv, 2, 4, 32, new_seen("cpu"))
    after = fp8_attention(qkv, 2, 4, 32, holding(part_amaxes(qkv) * 4))
    differ = (after[0].float() != alone[0].float()).float().mean()
    assert 0 < differ < 0.01 and torch.allclose(after[1], alone[1], rtol=0.02)


def test_a_batch_past_the_margin_over_what_was_seen_saturates():
    qkv = sample_qkv(2, 64, 4, 32)
    exact = float32_attention(qkv, 2, 4, 32)
    within = fp8_attention(qkv, 2, 4, 32, holding(part_amaxes(qkv) / MARGIN))
    past = fp8_attention(qkv, 2, 4, 32, holding(part_amaxes(qkv) / (4 * MARGIN)))
    assert relative_error(within, exact) < 0.08 < relative_error(past, exact)


def test_the_fp8_tower_with_fp8_attention_stays_close_to_bf16_attention():
    """The same FP8 tower with the attention in bf16 and in e4m3 (on the CPU through the
    definition): close, not equal; every layer says which it runs."""
    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=96, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    plain, quantized = (VisionTower(config).to(torch.bfloat16).eval() for _ in range(2))
    quantized.load_state_dict(plain.state_dict())
    report = fp8.FP8Report()
    with torch.no_grad():
        fp8.quantize_vision(plain, fp8.FP8Report())
        fp8.quantize_vision(quantized, report, fp8_attention=True)
    assert [layer.fp8_attention for layer in quantized.layers] == [True, True] and report.attention_layers == 2
    assert [layer.fp8_attention for layer in plain.layers] == [False, False]
    pixels = torch.randn(3, 3, 32, 32).to(torch.bfloat16)
    with torch.inference_mode():
        ours, theirs = quantized(pixels).float(), plain(pixels).float()
    error = float((ours - theirs).abs().mean() / theirs.abs().mean())
    assert 0 < error < 0.05


def test_a_layer_that_cannot_run_it_is_a_config_error():
    config = SiglipVisionConfig(hidden_size=72, intermediate_size=176, num_attention_heads=4)  # 72: not 16-aligned
    tower = VisionTower(config).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="FP8 vision attention needs"), torch.no_grad():
        fp8.quantize_vision(tower, fp8.FP8Report(), fp8_attention=True)


def test_the_cpu_cannot_run_it():
    assert "CUDA" in unsupported_reason(torch.device("cpu"))
    with pytest.raises(ConfigError) as error:
        fp8.check_attention_device(torch.device("cpu"))
    assert "\n" not in str(error.value) and "vision_attention_dtype=model" in str(error.value)


def test_the_option_names_what_sets_the_numbers_apart(tiny_model_dir):
    """Its K/V and image embeddings differ from FP8 GEMMs' alone: kept apart by the cache keys;
    under bf16 GEMMs the option changes nothing."""
    assert FastOptions().numerics_tag() is None
    assert FastOptions(vision_attention_dtype="fp8").numerics_tag() is None
    assert FastOptions(gemm_dtype="fp8").numerics_tag() == "fp8"
    assert FP8_ATTENTION.numerics_tag() == "fp8-attention"
    keys = set()
    for options in (FastOptions(gemm_dtype="fp8"), FP8_ATTENTION):
        engine = FastEngine(EngineConfig(str(tiny_model_dir), dtype="bfloat16", options=options), fp8_anywhere=True)
        keys.add(engine.keyer.model_id)
        engine.close()
    assert len(keys) == 2


# -- GPU -------------------------------------------------------------------------------------


def fp8_attention_gpu() -> bool:
    return torch.cuda.is_available() and unsupported_reason(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_attention_gpu(), reason="needs a Hopper GPU and nvidia-cudnn-frontend")
@pytest.mark.parametrize(
    ("batch", "length", "heads", "head_dim"),
    [(2, 4096, 16, 72), (5, 64, 3, 32)],  # Gemma-3-4B's tower (padded to 128); the demo captioner's (not padded)
)
@pytest.mark.parametrize("sharpness", [1.0, 3.0])
def test_cuda_op_against_the_definition(batch, length, heads, head_dim, sharpness):
    from wicore.ops.fp8_attention import load_cuda_kernels

    load_cuda_kernels()
    qkv = sample_qkv(batch, length, heads, head_dim, "cuda", sharpness)
    exact = float32_attention(qkv, batch, heads, head_dim)
    seen, seen_reference = new_seen("cuda"), new_seen("cuda")
    ours = fp8_attention(qkv, batch, heads, head_dim, seen)
    definition = fp8_attention_reference(qkv, batch, heads, head_dim, seen_reference)
    assert ours[0].shape == definition[0].shape and ours[1].shape == definition[1].shape
    assert torch.equal(seen_maxima(seen), seen_maxima(seen_reference)) and torch.equal(
        seen_maxima(seen), part_amaxes(qkv)
    )
    # cuDNN also rounds the softmax probabilities to e4m3: ~6% (random) to ~11% (peaked) measured at 4B's shape
    assert relative_error(ours, exact) < relative_error(definition, exact) + 0.1
    assert relative_error(ours, exact) < 0.15


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_attention_gpu(), reason="needs a Hopper GPU and nvidia-cudnn-frontend")
def test_cuda_op_replays_in_a_graph_and_compiles():
    from wicore.ops.fp8_attention import load_cuda_kernels

    load_cuda_kernels()
    qkv = sample_qkv(3, 4096, 16, 72, "cuda")
    eager = fp8_attention(qkv, 3, 16, 72, new_seen("cuda"))
    seen = new_seen("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_attention(qkv, 3, 16, 72, seen)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_attention(qkv, 3, 16, 72, seen)
    seen.zero_()
    graph.replay()  # a first call again: its own amax, then kept
    torch.cuda.synchronize()
    assert bitwise_equal(captured, eager) and torch.equal(seen_maxima(seen), part_amaxes(qkv))
    compiled_seen = new_seen("cuda")
    compiled = torch.compile(lambda x, s: fp8_attention(x * 1, 3, 16, 72, s), fullgraph=True)(qkv, compiled_seen)
    assert bitwise_equal(compiled, eager) and torch.equal(seen_maxima(compiled_seen), part_amaxes(qkv))


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_attention_gpu(), reason="needs a Hopper GPU and nvidia-cudnn-frontend")
def test_cuda_engine_with_fp8_attention_keeps_the_captions():
    """The demo captioner through the product path (compiled tower, graphs) with FP8 GEMMs, with
    and without FP8 attention: its captions stay."""
    from tests.test_fast_fp8 import democap

    runs = {}
    for attention in ("model", "fp8"):
        options = FastOptions(
            gemm_dtype="fp8", vision_attention_dtype=attention, num_kv_blocks=4096, compile_vision=True,
            compile_text=True, vision_compile_mode="default",
        )  # fmt: skip
        runs[attention] = democap(options, 64, device="cuda")
    assert sum(a == b for a, b in zip(runs["model"][0], runs["fp8"][0])) >= 56
    assert runs["fp8"][1] >= runs["model"][1] - 3


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_attention_gpu(), reason="needs a Hopper GPU and nvidia-cudnn-frontend")
def test_cuda_engine_scales_its_first_batch_by_its_own_images_not_the_warm_ups():
    """Compiling and capturing the tower runs it on made-up images: the engine forgets what its
    attention saw then, and real batches fill it in."""
    from wicore.models import DEMOCAP_DIR
    from wicore.models.democap import evaluate

    options = FastOptions(gemm_dtype="fp8", vision_attention_dtype="fp8", num_kv_blocks=4096, compile_vision=True,
                          vision_compile_mode="default")  # fmt: skip
    engine = FastEngine(
        EngineConfig(str(DEMOCAP_DIR), dtype="bfloat16", max_batch_size=16, options=options, device="cuda")
    )
    try:
        assert engine.runner.vision_graphs is not None  # the capture ran
        seen = [layer.attention_seen for layer in engine.runner.parts.encoder.vision_tower.layers]
        assert all(not s.any() for s in seen)
        evaluate.engine_captions(engine, evaluate.main_samples(16, seed=1000))
        assert all(bool((seen_maxima(s) > 0).all() and torch.isfinite(s).all()) for s in seen)
    finally:
        engine.close()
