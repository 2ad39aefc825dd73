"""FP8 linear layers (`wicore.ops.fp8`): quantization error bounds, the scaled matmul against its
plain-torch reference (torch's CPU `_scaled_mm` here; CUDA's in the GPU tests), and the capture
and compile paths the engine uses on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wicore.ops.fp8 import (
    E4M3,
    E4M3_MAX,
    FP8Weight,
    dequantize,
    fits,
    fp8_linear,
    fp8_linear_reference,
    linear,
    quantize,
    quantize_weight,
    unsupported_reason,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MANTISSA_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: neighbouring normal values differ by 1/8 of the lower one
SUBNORMAL_STEP = 2.0**-9  # spacing of e4m3's subnormals (and of the values below its smallest normal)


def tensors(*shape, seed=0, device="cpu", dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device, dtype)


def assert_within_rounding(original: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor) -> None:
    """Round-to-nearest in e4m3: at most half a step of the value's binade (times the scale)."""
    error = (original.float() - quantized.float() * scale).abs()
    bound = torch.maximum(original.float().abs() * MANTISSA_STEP / 2, scale * SUBNORMAL_STEP / 2)
    assert (error <= bound * 1.0001 + 1e-30).all()


@pytest.mark.parametrize("rowwise", [True, False])
def test_quantize_is_within_half_a_step_and_fills_the_range(rowwise):
    x = tensors(37, 96) * torch.logspace(-3, 3, 37)[:, None].to(torch.bfloat16)  # rows of very different size
    q, scale = quantize(x, rowwise)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert scale.shape == ((37, 1) if rowwise else ())
    assert_within_rounding(x, q, scale)
    peaks = q.float().abs().amax(dim=-1) if rowwise else q.float().abs().amax()
    assert (peaks == E4M3_MAX).all()  # each row's (the tensor's) largest value lands on the top of the range


def test_weight_scales_are_per_output_channel():
    weight = tensors(48, 64) * torch.arange(1, 49)[:, None].to(torch.bfloat16)
    quantized = quantize_weight(weight)
    assert quantized.data.shape == (48, 64) and quantized.data.is_contiguous()
    assert quantized.scale.shape == (1, 48) and quantized.scale.is_contiguous()
    assert_within_rounding(weight, quantized.data, quantized.scale.reshape(-1, 1))
    torch.testing.assert_close(dequantize(quantized), weight.float(), rtol=MANTISSA_STEP / 2, atol=1e-3)
    assert quantize_weight(weight, rowwise=False).scale.shape == ()


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_equals_the_reference(rowwise, bias):
    x = tensors(3, 5, 64, seed=1)  # leading dims flattened to tokens and restored
    weight = quantize_weight(tensors(80, 64, seed=2) * 0.05, rowwise)
    b = tensors(80, seed=3) if bias else None
    got = fp8_linear(x, weight, b)
    assert got.shape == (3, 5, 80) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fp8_linear_reference(x, weight, b), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_linear_stays_close_to_the_bf16_linear(rowwise):
    x, weight, bias = tensors(256, 128, seed=4), tensors(64, 128, seed=5) * 0.05, tensors(64, seed=6)
    want = F.linear(x.float(), weight.float(), bias.float())
    got = fp8_linear(x, quantize_weight(weight, rowwise), bias).float()
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999
    # Two roundings of at most 1/16 each, mostly cancelling over 128 products.
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.05


def test_zero_rows_give_zeros_not_nans():
    # Graph buckets pad with zero rows; their scale is floored, not divided by.
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    out = fp8_linear(x, quantize_weight(tensors(32, 64)), tensors(32, seed=7))
    assert torch.equal(out, tensors(32, seed=7).expand(4, 32))


def test_linear_dispatches_on_the_weight_type():
    x, weight = tensors(6, 32), tensors(16, 32, seed=8)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    quantized = quantize_weight(weight)
    assert isinstance(quantized, FP8Weight)
    assert torch.equal(linear(x, quantized), fp8_linear(x, quantized))


def test_alignment_and_device_support():
    assert fits(4096, 2560) and fits(1152, 4304) and not fits(916, 64) and not fits(64, 72)
    assert "cpu" in unsupported_reason(torch.device("cpu"))


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rowwise", [True, False])
def test_cuda_scaled_mm_equals_the_reference_at_the_4b_shapes(rowwise):
    if unsupported_reason(torch.device("cuda")):
        pytest.skip(unsupported_reason(torch.device("cuda")))
    for tokens, k, n in [(4096, 1152, 3456), (4096, 4304, 1152), (333, 2560, 20480), (7, 10240, 2560)]:
        x = tensors(tokens, k, device="cuda")
        weight = quantize_weight(tensors(n, k, seed=1, device="cuda") * k**-0.5, rowwise)
        bias = tensors(n, seed=2, device="cuda")
        got, want = fp8_linear(x, weight, bias), fp8_linear_reference(x, weight, bias)
        # Hopper's fast FP8 accumulation keeps fewer bits than float32 (and bf16 output rounds):
        # compare the whole product as the engine uses it, relative to its norm.
        cosine = F.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0).item()
        relative = ((got.float() - want.float()).norm() / want.float().norm()).item()
        shape = (tokens, k, n)
        assert cosine > 0.9999 and relative < 0.01, f"{shape}: cosine {cosine:.6f}, relative error {relative:.4f}"


@pytest.mark.gpu
@CUDA
def test_cuda_graph_capture_and_compile():
    """No host syncs: the quantize + scaled matmul replays in a CUDA graph and compiles whole."""
    if unsupported_reason(torch.device("cuda")):
        pytest.skip(unsupported_reason(torch.device("cuda")))
    x = tensors(64, 256, device="cuda")
    weight, bias = quantize_weight(tensors(128, 256, seed=1, device="cuda") * 0.05), tensors(128, device="cuda")
    eager = fp8_linear(x, weight, bias)
    compiled = torch.compile(fp8_linear, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(x, weight, bias), eager, rtol=0.02, atol=0.02)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (cuBLASLt handles, workspace)
        for _ in range(2):
            fp8_linear(static, weight, bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(static, weight, bias)
    static.copy_(x * 2)
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x * 2, weight, bias))
