"""The vision tower's attention in FP8 (e4m3) on Hopper: cuDNN's fused FP8 forward, from the fused
q/k/v GEMM's output to the out projection's rowwise e4m3 input.

    qkv [M = batch * length, 3 * heads * head_dim] (bf16, as the GEMM wrote it)
      -> q, k, v in e4m3, one scale each (448 / (MARGIN * amax)), heads zero-padded to
         `padded_head_dim`
      -> cuDNN SDPA in FP8 (softmax probabilities in e4m3 at scale 448; O in e4m3 at
         448 / (MARGIN * amax_v), |O| <= max|v| since each row of O averages rows of v)
      -> O requantized per row: (e4m3 [M, heads * head_dim], float32 scale [M, 1]).

Which amax (delayed scaling, as Transformer Engine's amax history): a layer keeps `seen`, the
largest |q|, |k|, |v| of its earlier calls, and scales by that; a call before any (`seen` zero)
scales by its own. Each call raises `seen` to its own maxima. So the CUDA chain needs no pass
over q, k and v before quantizing them, and a batch whose
values outgrow every earlier one by up to MARGIN still fits. MARGIN is a power of two: a scale
halved shifts every e4m3 code's exponent and keeps its mantissa, so values round as at margin 1
unless they are so small (below ~2^-13 of the amax scaled by) that e4m3 holds them as subnormals.

Why padded: cuDNN's FP8 forward on Hopper takes head dims that are multiples of 16, and SigLIP's
is 72. Zero columns of q and k add nothing to q.k and zero columns of v give zero columns of O,
which are dropped. Padded to 128, not 80: its kernels' tiles are 128 wide, so 128 runs faster
than 80 (and than bf16 SDPA at 72; docs/benchmarks.md).

What it costs: the output's error against float32 attention was ~5.6% of its mean magnitude on
random-weight activations and ~11% on peaked attention (bf16 SDPA with the same rowwise
requantization: ~2.3%); the benchmark reports what that does to tokens and to the demo captioner.

On CUDA the chain is one custom op (ops/fp8_attention_cuda.py: Triton passes around cuDNN, through
the `nvidia-cudnn-frontend` package, the `fp8` extra); elsewhere `fp8_attention_reference`, the
same quantization steps in plain torch around float32 attention (probabilities not quantized).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wicore.ops.fp8 import quantize as quantize_rows
from wicore.ops.fp8_format import AMAX_FLOOR, E4M3, E4M3_MAX, MARGIN, SEEN_SLOTS

MIN_CAPABILITY = (9, 0)  # cuDNN's FP8 attention forward: Hopper and newer


def unsupported_reason(device: torch.device) -> str | None:
    """Why `device` cannot run the FP8 attention (None: it can)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} is compute capability {major}.{minor} (cuDNN's FP8 attention needs 9.0+)"
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except ImportError:
        return "the nvidia-cudnn-frontend package is not installed (pip install 'wicore[fp8]')"
    return None


def load_cuda_kernels() -> None:
    """Register `torch.ops.wicore.fp8_attention` (imports triton and cudnn): once, before a CUDA
    tensor reaches `fp8_attention`, outside code that torch.compile traces."""
    import wicore.ops.fp8_attention_cuda  # noqa: F401


def prepare(device: torch.device, batches: list[int], heads: int, length: int, head_dim: int) -> float:
    """Build cuDNN's plans for these batch sizes before the first batches arrive (CUDA; after
    `load_cuda_kernels`); returns the seconds spent."""
    from wicore.ops.fp8_attention_cuda import prepare as build

    return build(device, batches, heads, length, head_dim)


def new_seen(device) -> torch.Tensor:
    """A layer's `seen` before its first call: float32 [3, SEEN_SLOTS] whose rows' maxima are the
    largest |q|, |k|, |v| so far (`seen_maxima`)."""
    return torch.zeros((3, SEEN_SLOTS), dtype=torch.float32, device=device)


def seen_maxima(seen: torch.Tensor) -> torch.Tensor:
    """The largest |q|, |k|, |v| a `seen` holds: float32 [3]."""
    return seen.amax(dim=1)


def fp8_attention(
    qkv: torch.Tensor, batch: int, heads: int, head_dim: int, seen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [batch * length, 3 * heads * head_dim] -> the out projection's input per row (e4m3
    [batch * length, heads * head_dim], float32 scale [batch * length, 1]); `seen` (`new_seen`)
    is raised to this call's maxima (module docstring)."""
    if qkv.is_cuda:
        return torch.ops.wicore.fp8_attention(qkv, batch, heads, head_dim, seen)
    return fp8_attention_reference(qkv, batch, heads, head_dim, seen)


def tensor_quantize(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x in e4m3 at one scale, so that MARGIN * `amax` lands on 448, as float32 values of x
    (quantized and dequantized)."""
    scale = E4M3_MAX / (MARGIN * amax.clamp(min=AMAX_FLOOR))
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / scale


def fp8_attention_reference(
    qkv: torch.Tensor, batch: int, heads: int, head_dim: int, seen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_attention` in plain torch: q, k and v rounded to e4m3 at one scale each (from `seen`,
    or their own amax on a first call), attention in float32, O rounded to e4m3 at v's scale,
    then quantized per row; `seen` raised to this call's maxima."""
    rows = qkv.shape[0]
    length = rows // batch
    parts = qkv.view(rows, 3, heads * head_dim).float()
    magnitudes = parts.abs()
    amax = magnitudes.amax(dim=(0, 2))
    earlier = seen_maxima(seen)
    by = torch.where(earlier > 0, earlier, amax)
    q, k, v = (tensor_quantize(parts[:, i], by[i]) for i in range(3))
    q, k, v = (t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)
    out = tensor_quantize(out, by[2])
    finite = magnitudes.nan_to_num(0.0, posinf=0.0).amax(dim=(0, 2))  # an inf or nan must not stick
    seen[:, 0] = torch.maximum(seen[:, 0], finite)
    return quantize_rows(out.transpose(1, 2).reshape(rows, heads * head_dim))
