"""FP8 (e4m3) linear layers: weights quantized once, activations quantized on the fly, one
scaled matmul (`torch._scaled_mm`) with float32 accumulation, bf16 out.

Two scalings, picked by the weight's scale shape:
- rowwise (the default): a float32 scale per output channel of the weight ([1, N]) and per
  token of the activations ([M, 1]); torch's CUTLASS rowwise kernel (sm89+);
- tensorwise: one scale each (shape []); cuBLASLt.
Activation scales come from the data on the device (amax, no `.item()`), so the functions run
inside CUDA graphs and compile with inductor, which fuses the quantization into the kernel
that produces the activations (a norm). After a GELU, rows are wide (4,304 in SigLIP's MLP,
10,240 in Gemma's), where inductor's fused kernel reads each row twice, far below bandwidth:
`bias_gelu_quantize` and `gelu_mul_quantize` do that step in one Triton pass on CUDA
(ops/fp8_triton.py) and in plain torch elsewhere, as `add_layer_norm_quantize` does for the
vision tower's LayerNorms with the residual add before them (inductor's fusion reads twice too).

`_scaled_mm` wants mat1 [M, K] row-major, mat2 [K, N] column-major (a row-major [N, K] weight,
transposed: no copy), K and N multiples of 16, and a bias in the output dtype. The same call
runs on the CPU in torch >= 2.7 (slowly), which is how the CPU tests exercise it;
`fp8_linear_reference` (dequantize, then a float32 matmul) is the plain-torch definition both
are tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from wicore.ops.fp8_format import AMAX_FLOOR, E4M3, E4M3_MAX

ALIGNMENT = 16  # K and N of every FP8 GEMM
MIN_CAPABILITY = (8, 9)  # Ada and Hopper have e4m3 tensor cores


class FP8Weight(NamedTuple):
    """A linear layer's weight in e4m3: `data` [N, K] row-major, `scale` float32 [1, N]
    (rowwise) or [] (tensorwise); weight ~= data * scale.T."""

    data: torch.Tensor
    scale: torch.Tensor


def fits(out_features: int, in_features: int) -> bool:
    """Whether a [out, in] weight meets `_scaled_mm`'s alignment."""
    return out_features % ALIGNMENT == 0 and in_features % ALIGNMENT == 0


def quantize(x: torch.Tensor, rowwise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1] per row, or [] for the whole tensor):
    each row (or the tensor) scaled so its largest magnitude lands on E4M3_MAX."""
    h = x.float()
    amax = h.abs().amax(dim=-1, keepdim=True) if rowwise else h.abs().amax()
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (h / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_weight(weight: torch.Tensor, rowwise: bool = True) -> FP8Weight:
    """[N, K] high-precision weight -> FP8Weight, a scale per output channel (rowwise) or one."""
    data, scale = quantize(weight, rowwise)
    return FP8Weight(data.contiguous(), scale.reshape(1, -1).contiguous() if rowwise else scale)


def dequantize(weight: FP8Weight) -> torch.Tensor:
    """[N, K] float32: what the quantized weight stands for."""
    return weight.data.float() * weight.scale.reshape(-1, 1)


def fp8_linear(
    x: torch.Tensor,
    weight: FP8Weight,
    bias: torch.Tensor | None = None,
    fast_accum: bool = True,
    bias_in_epilogue: bool = False,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x quantized per token (per tensor for a tensorwise
    weight), one scaled matmul, the bias added after it or in its epilogue (`scaled_mm`).
    `fast_accum`: Hopper's faster FP8 accumulation (fewer promotions to float32), as inference
    libraries use."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize(rows, rowwise=weight.scale.dim() > 0)
    out = scaled_mm(x_q, x_scale, weight, bias, x.dtype, fast_accum, bias_in_epilogue)
    return out.reshape(*x.shape[:-1], weight.data.shape[0])


def scaled_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: FP8Weight,
    bias: torch.Tensor | None,
    out_dtype,
    fast_accum: bool,
    bias_in_epilogue: bool = False,
) -> torch.Tensor:
    """The matmul alone: quantized x [M, K] and its scale ([M, 1] or []) -> [M, N] in out_dtype.
    By default the bias is added after it: cuBLASLt has no rowwise-scaled algorithm with a bias
    for some shapes (a few rows of 10240 -> 2560), and inductor fuses the add into what follows.
    `bias_in_epilogue` for row counts where it has one (the vision tower's, multiples of an
    image's patches): the output then needs no pass of its own before a consumer that reads it
    as strided views (the fused q/k/v into attention: a small share of a layer)."""
    epilogue = bias if bias_in_epilogue else None
    out = torch._scaled_mm(
        x_q,
        weight.data.t(),
        scale_a=x_scale,
        scale_b=weight.scale,
        bias=None if epilogue is None else epilogue.to(out_dtype),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return out if bias is None or bias_in_epilogue else out + bias.to(out_dtype)


def bias_gelu_quantize(h: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [..., N] (a GEMM's output, its bias not yet added) -> (e4m3 of GELU-tanh(h + bias) [M, N],
    float32 scale per row [M, 1]): the next FP8 GEMM's input. On CUDA one Triton pass
    (ops/fp8_triton.py; `load_cuda_kernels` first), elsewhere this chain in plain torch; both
    round the sum and the GELU to h's dtype before taking the amax."""
    rows = h.reshape(-1, h.shape[-1])
    if rows.is_cuda:
        return torch.ops.wicore.gelu_quantize(rows, bias, False)
    summed = rows if bias is None else rows + bias.to(rows.dtype)
    return quantize(F.gelu(summed, approximate="tanh"))


def gelu_mul_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2N] (a fused gate/up projection's output) -> (e4m3 of GELU-tanh(gate) * up
    [M, N], float32 scale per row [M, 1]), as `bias_gelu_quantize`: one pass on CUDA."""
    if gate_up.is_cuda:
        return torch.ops.wicore.gelu_quantize(gate_up, None, True)
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize(F.gelu(gate, approximate="tanh") * up)


def gated_gelu_linear(gate_up: torch.Tensor, weight: torch.Tensor | FP8Weight, approximate: str) -> torch.Tensor:
    """down(GELU(gate) * up) for a fused gate/up output [M, 2N]: with a rowwise FP8Weight and the
    tanh GELU, the product is quantized in the pass that computes it (`gelu_mul_quantize`)."""
    if isinstance(weight, FP8Weight) and weight.scale.dim() > 0 and approximate == "tanh":
        x_q, x_scale = gelu_mul_quantize(gate_up)
        return scaled_mm(x_q, x_scale, weight, None, gate_up.dtype, fast_accum=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return linear(F.gelu(gate, approximate=approximate) * up, weight)


def add_layer_norm_quantize(
    x: torch.Tensor, pending: torch.Tensor | None, norm: torch.nn.LayerNorm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A residual stream x [..., N] and its addend not yet added (None: none) -> (x + pending,
    e4m3 of norm(x + pending) [M, N], float32 scale per row [M, 1]): the sum and the next FP8
    GEMM's input in one pass on CUDA (ops/fp8_triton.py), this chain in plain torch elsewhere;
    both round the sum and the norm's output to x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        if pending is None:
            return x, *torch.ops.wicore.layer_norm_quantize(rows, norm.weight, norm.bias, norm.eps)
        summed, q, scale = torch.ops.wicore.add_layer_norm_quantize(
            rows, pending.reshape(rows.shape), norm.weight, norm.bias, norm.eps
        )
        return summed.view(x.shape), q, scale
    summed = x if pending is None else x + pending
    return summed, *quantize(norm(summed).reshape(rows.shape))


def load_cuda_kernels() -> None:
    """Register the CUDA ops that `bias_gelu_quantize`, `gelu_mul_quantize` and
    `add_layer_norm_quantize` call (imports triton): once, before a CUDA tensor reaches them,
    outside code that torch.compile traces."""
    import wicore.ops.fp8_triton  # noqa: F401


def fp8_linear_reference(x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear` in plain torch: the same quantization, then dequantize and multiply in float32."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize(rows, rowwise=weight.scale.dim() > 0)
    out = (x_q.float() * x_scale) @ dequantize(weight).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.data.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor | FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight, `fp8_linear` for an FP8Weight: model code calls this one
    function whichever precision its weights were loaded in."""
    if isinstance(weight, FP8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def unsupported_reason(device: torch.device) -> str | None:
    """Why `device` has no FP8 tensor cores (None: it has them)."""
    if device.type != "cuda":
        return f"the device is {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} is compute capability {major}.{minor}"
    return None
