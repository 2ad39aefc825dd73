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
    add_layer_norm_quantize,
    bias_gelu_quantize,
    dequantize,
    fits,
    fp8_linear,
    fp8_linear_reference,
    gated_gelu_linear,
    gelu_mul_quantize,
    linear,
    load_cuda_kernels,
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


def bitwise_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    """Outputs (e4m3 codes, scales, sums) equal bit for bit, pair by pair (e4m3 compared as bytes)."""
    as_bits = [t.view(torch.uint8) if t.dtype == E4M3 else t for t in (*got, *want)]
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(as_bits[: len(got)], as_bits[len(got) :]))


def assert_codes_close(got: torch.Tensor, want: torch.Tensor, differing: float) -> None:
    """e4m3 tensors whose codes differ by at most one step, in under `differing` of them."""
    if got.numel():
        codes = got.view(torch.uint8).int() - want.view(torch.uint8).int()
        assert codes.abs().max().item() <= 1 and (codes != 0).float().mean().item() < differing


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


def test_the_gated_mlp_quantizes_what_the_unfused_chain_does():
    """gated_gelu_linear's FP8 path (the product quantized in one function) against linear() of
    the product: bit for bit on the CPU; bf16 and tensorwise weights take the plain chain."""
    gate_up = tensors(9, 2 * 96, seed=4)
    rowwise, tensorwise = quantize_weight(tensors(32, 96, seed=5) * 0.1), quantize_weight(tensors(32, 96) * 0.1, False)
    gate, up = gate_up.chunk(2, dim=-1)
    product = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(gated_gelu_linear(gate_up, rowwise, "tanh"), linear(product, rowwise))
    assert torch.equal(gated_gelu_linear(gate_up, tensorwise, "tanh"), linear(product, tensorwise))
    exact = F.gelu(gate, approximate="none") * up
    assert torch.equal(gated_gelu_linear(gate_up, rowwise, "none"), linear(exact, rowwise))


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


@pytest.mark.gpu
@CUDA
def test_cuda_bias_gelu_quantize_equals_the_torch_chain():
    """The one-pass Triton kernel against the chain it replaces, run by torch on the same device:
    the same per-row scales, and e4m3 codes that differ by at most one step where the hardware's
    tanh approximation rounds a GELU value to the other bf16 neighbour (~0.15% of them)."""
    load_cuda_kernels()

    def chain(h, bias):
        summed = h if bias is None else h + bias
        return quantize(F.gelu(summed, approximate="tanh").reshape(-1, h.shape[-1]))

    for rows, width, with_bias in [
        (4096, 4304, True),
        (333, 10240, False),
        (5, 72, True),
        (3, 64, False),
        (0, 4304, True),
    ]:
        h = tensors(rows, width, device="cuda") * 3
        h[1::7] = 0  # whole rows of zeros (graph padding): the floor scale, no NaNs
        bias = tensors(width, seed=1, device="cuda") if with_bias else None
        got_q, got_scale = bias_gelu_quantize(h, bias)
        want_q, want_scale = chain(h, bias)
        assert got_q.dtype == E4M3 and got_q.shape == (rows, width) and got_scale.shape == (rows, 1)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        assert_codes_close(got_q, want_q, differing=0.01)
    for rows, width in [(384, 10240), (7, 4304)]:  # gated: GELU(gate) * up of a fused [M, 2N] gate/up output
        gate_up = tensors(rows, 2 * width, seed=3, device="cuda") * 2
        got_q, got_scale = gelu_mul_quantize(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        want_q, want_scale = quantize(F.gelu(gate, approximate="tanh") * up)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        assert_codes_close(got_q, want_q, differing=0.01)
    strided = tensors(64, 8704, device="cuda")[:, :4304]  # a row stride past the width: read as a view
    torch.testing.assert_close(bias_gelu_quantize(strided)[1], chain(strided, None)[1], rtol=1e-6, atol=0)


@pytest.mark.gpu
@CUDA
def test_cuda_bias_gelu_quantize_compiles_and_replays_in_a_graph():
    load_cuda_kernels()
    h, bias = tensors(256, 4304, device="cuda"), tensors(4304, seed=1, device="cuda")
    eager = bias_gelu_quantize(h, bias)
    compiled = torch.compile(bias_gelu_quantize, fullgraph=True)(h, bias)
    assert bitwise_equal(compiled, eager)
    static = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bias_gelu_quantize(static, bias)
    static.copy_(h * 2)
    graph.replay()
    assert bitwise_equal(out, bias_gelu_quantize(h * 2, bias))


@pytest.mark.gpu
@CUDA
def test_cuda_add_layer_norm_quantize_equals_the_torch_chain():
    """The one-pass residual add + LayerNorm + quantization against the chain it replaces, run
    by torch on the same device: the sum bit for bit, the same row scales, e4m3 codes at most one
    step apart where the norm's output rounds to the other bf16 neighbour (two-pass statistics
    against torch's Welford)."""
    load_cuda_kernels()
    for rows, width, pending in [
        (4096, 1152, True),
        (333, 1152, False),
        (5, 72, True),
        (3, 64, False),
        (0, 1152, True),
    ]:
        x = tensors(rows, width, device="cuda") * 3
        delta = tensors(rows, width, seed=2, device="cuda") if pending else None
        norm = torch.nn.LayerNorm(width, eps=1e-6, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(tensors(width, seed=3) * 0.5 + 1)
            norm.bias.copy_(tensors(width, seed=4) * 0.1)
        x[1::7] = 0.5  # constant rows (their sum too): normed to the bias, no NaNs
        if pending:
            delta[1::7] = 0
        with torch.inference_mode():
            got_sum, got_q, got_scale = add_layer_norm_quantize(x, delta, norm)
            want_sum = x if delta is None else x + delta
            want_q, want_scale = quantize(norm(want_sum))
        assert torch.equal(got_sum, want_sum) and got_q.dtype == E4M3 and got_scale.shape == (rows, 1)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        assert_codes_close(got_q, want_q, differing=0.001)


@pytest.mark.gpu
@CUDA
def test_cuda_add_layer_norm_quantize_compiles_and_replays_in_a_graph():
    load_cuda_kernels()
    x, delta = tensors(2, 256, 1152, device="cuda"), tensors(2, 256, 1152, seed=1, device="cuda")
    norm = torch.nn.LayerNorm(1152, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = add_layer_norm_quantize(x, delta, norm)
        assert eager[0].shape == x.shape and eager[1].shape == (512, 1152)
        assert bitwise_equal(torch.compile(add_layer_norm_quantize, fullgraph=True)(x, delta, norm), eager)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = add_layer_norm_quantize(static, delta, norm)
        static.copy_(x * 2)
        graph.replay()
        assert bitwise_equal(out, add_layer_norm_quantize(x * 2, delta, norm))
