"""One-pass activation quantization on CUDA (imported lazily: only CUDA needs triton).

The input of an FP8 GEMM that follows a GELU, quantized per row in the pass that computes it:
- SigLIP's MLP: fc1's output h [M, N] (bias not yet added) -> e4m3 of GELU-tanh(h + bias);
- Gemma's gated MLP: the fused gate/up output [M, 2N] -> e4m3 of GELU-tanh(gate) * up [M, N];
each with a float32 scale per row [M, 1]. Inductor compiles these chains as looped reductions
over rows this long (4,304 and 10,240: past its persistent-reduction size), which read every
row twice, far below the memory's bandwidth. Here a program holds its whole row in registers (a
power-of-two head and a short tail, so few lanes idle): the row is read once and written once
as e4m3, near the bandwidth. A custom op, so `torch.compile` and CUDA graphs call the kernel as it is.

Rounding follows the eager chain in bf16 (`quantize(F.gelu(h + bias, approximate="tanh"))`,
`quantize(F.gelu(gate, approximate="tanh") * up)`): the sum, the GELU and the product are
rounded to h's dtype before the amax, as eager (and inductor with `emulate_precision_casts`)
round them. The tanh is the hardware's approximation (libdevice's tanhf left the kernel
compute-bound at half the speed), so a GELU value within ~2^-11 of a bf16 rounding boundary can
round the other way: ~0.15% of the e4m3 codes differ from eager's by one step.

And the input of an FP8 GEMM that follows a LayerNorm (SigLIP's two a layer), with the residual
add before the norm in the same pass: x [M, N] + pending [M, N] -> the new residual stream (bf16,
written once) and e4m3 of LayerNorm(sum) with its row scale. Inductor's fused norm + quantize
chain reads each row twice too at the tower's 1,152 columns. Rounding as eager's chain: the sum and the
norm's output are rounded to x's dtype; the mean and variance are two-pass float32 sums where
torch uses Welford, so a norm output next to a bf16 rounding boundary can round the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wicore.ops.fp8_format import AMAX_FLOOR, E4M3, E4M3_MAX

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a constexpr: jit code reads no other globals


@triton.jit
def _gelu_tanh(x):
    """GELU, tanh form, in float32, with tanh.approx.f32 (max relative error ~2^-11)."""
    inner = SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
    tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32, is_pure=True, pack=1)
    return 0.5 * x * (1.0 + tanh)


@triton.jit
def _activation(h_row, bias_ptr, cols, inside, n_cols, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """At `cols` of one row, in float32, each step rounded to h's dtype: GELU(h + bias), or
    GELU(gate) * up with gate = h[cols], up = h[n_cols + cols]. Padding columns give 0."""
    h = tl.load(h_row + cols, mask=inside, other=0.0)
    x = h.to(tl.float32)
    if HAS_BIAS:
        x = (x + tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)).to(h.dtype).to(tl.float32)
    y = _gelu_tanh(x).to(h.dtype).to(tl.float32)
    if GATED:
        up = tl.load(h_row + n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        y = (y * up).to(h.dtype).to(tl.float32)
    return y


@triton.jit
def _store_e4m3(q_row, y, cols, inside, scale, fp8_max):
    """y / scale at `cols` of one row, saturated to e4m3's range, stored in q_row's dtype."""
    q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=inside)


@triton.jit
def _gelu_quantize_kernel(
    h_ptr,  # [M, N] (or [M, 2N] gated), row stride stride_h, unit column stride
    bias_ptr,  # [N] (unused without HAS_BIAS)
    q_ptr,  # [M, N] e4m3, contiguous
    scale_ptr,  # [M] float32
    n_cols,  # N
    stride_h,
    amax_floor,
    fp8_max,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    HEAD: tl.constexpr,  # the largest power of two <= N
    TAIL: tl.constexpr,  # the rest, rounded up to a power of two (0: none); 4,304 = 4,096 + 208 of 256
):
    row = tl.program_id(0).to(tl.int64)
    h_row, q_row = h_ptr + row * stride_h, q_ptr + row * n_cols
    head = tl.arange(0, HEAD)
    y_head = _activation(h_row, bias_ptr, head, head < n_cols, n_cols, HAS_BIAS, GATED)
    amax = tl.max(tl.abs(y_head), axis=0)
    if TAIL > 0:
        tail = HEAD + tl.arange(0, TAIL)
        y_tail = _activation(h_row, bias_ptr, tail, tail < n_cols, n_cols, HAS_BIAS, GATED)
        amax = tl.maximum(amax, tl.max(tl.abs(y_tail), axis=0))
    scale = tl.maximum(amax, amax_floor) / fp8_max
    _store_e4m3(q_row, y_head, head, head < n_cols, scale, fp8_max)
    if TAIL > 0:
        _store_e4m3(q_row, y_tail, tail, tail < n_cols, scale, fp8_max)
    tl.store(scale_ptr + row, scale)


@torch.library.custom_op("wicore::gelu_quantize", mutates_args=())
def gelu_quantize(h: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, N] (+ bias [N]) or, gated, [M, 2N] -> (e4m3 [M, N], float32 scale [M, 1])."""
    if h.stride(-1) != 1:
        h = h.contiguous()
    m, n = h.shape[0], h.shape[1] // 2 if gated else h.shape[1]
    q, scale = empty_quantized_rows(m, n, h.device)
    if m and n:
        _gelu_quantize_kernel[(m,)](
            h,
            h if bias is None else bias,
            q,
            scale,
            n,
            h.stride(0),
            AMAX_FLOOR,
            E4M3_MAX,
            HAS_BIAS=bias is not None,
            GATED=gated,
            **_row_split(n),
        )
    return q, scale


def empty_quantized_rows(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of a row quantization: e4m3 [M, N] and float32 scales [M, 1]."""
    return torch.empty((m, n), dtype=E4M3, device=device), torch.empty((m, 1), dtype=torch.float32, device=device)


def _row_split(n: int) -> dict[str, int]:
    """A row of n held in registers: the largest power of two <= n, the rest rounded up to a power
    of two (0: none), and warps for the head (1,024 columns each, 1 to 8). Fewer warps a row keep
    more rows in flight an SM: at the tower's row counts, add + LayerNorm + quantize (1,152
    columns) runs fastest with 1 warp, GELU + quantize (4,304) with 4."""
    head = 1 << (n.bit_length() - 1)
    return {
        "HEAD": head,
        "TAIL": 0 if head == n else triton.next_power_of_2(n - head),
        "num_warps": max(1, min(8, head // 1024)),
    }


@gelu_quantize.register_fake
def _(h: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = h.shape[1] // 2 if gated else h.shape[1]
    return h.new_empty((h.shape[0], n), dtype=E4M3), h.new_empty((h.shape[0], 1), dtype=torch.float32)


@triton.jit
def _residual_sum(x_row, pending_row, sum_row, cols, inside, HAS_PENDING: tl.constexpr):
    """x (+ pending, rounded to x's dtype and stored at sum_row) at `cols`, in float32; 0 outside."""
    x = tl.load(x_row + cols, mask=inside, other=0.0)
    if HAS_PENDING:
        x = (x.to(tl.float32) + tl.load(pending_row + cols, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_row + cols, x, mask=inside)
    return x.to(tl.float32)


@triton.jit
def _normed(deviation, rstd, weight_ptr, bias_ptr, cols, inside, dtype):
    """LayerNorm's output at `cols` from the row's deviations from its mean, rounded to `dtype`."""
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return (deviation * rstd * weight + bias).to(dtype).to(tl.float32)


@triton.jit
def _add_layer_norm_quantize_kernel(
    x_ptr,  # [M, N] contiguous
    pending_ptr,  # [M, N] contiguous (unused without HAS_PENDING)
    sum_ptr,  # [M, N]: x + pending (unused without HAS_PENDING)
    weight_ptr,  # [N]
    bias_ptr,  # [N]
    q_ptr,  # [M, N] e4m3
    scale_ptr,  # [M] float32
    n_cols,
    eps,
    amax_floor,
    fp8_max,
    HAS_PENDING: tl.constexpr,
    HEAD: tl.constexpr,  # the largest power of two <= N
    TAIL: tl.constexpr,  # the rest, rounded up to a power of two (0: none); 1,152 = 1,024 + 128
):
    row = tl.program_id(0).to(tl.int64) * n_cols
    x_row, pending_row, sum_row, q_row = x_ptr + row, pending_ptr + row, sum_ptr + row, q_ptr + row
    head = tl.arange(0, HEAD)
    in_head = head < n_cols
    s_head = _residual_sum(x_row, pending_row, sum_row, head, in_head, HAS_PENDING)
    total = tl.sum(s_head, axis=0)
    if TAIL > 0:
        tail = HEAD + tl.arange(0, TAIL)
        in_tail = tail < n_cols
        s_tail = _residual_sum(x_row, pending_row, sum_row, tail, in_tail, HAS_PENDING)
        total += tl.sum(s_tail, axis=0)
    mean = total / n_cols
    d_head = tl.where(in_head, s_head - mean, 0.0)
    variance = tl.sum(d_head * d_head, axis=0)
    if TAIL > 0:
        d_tail = tl.where(in_tail, s_tail - mean, 0.0)
        variance += tl.sum(d_tail * d_tail, axis=0)
    rstd = tl.rsqrt(variance / n_cols + eps)
    dtype = x_ptr.dtype.element_ty
    y_head = _normed(d_head, rstd, weight_ptr, bias_ptr, head, in_head, dtype)
    amax = tl.max(tl.abs(y_head), axis=0)
    if TAIL > 0:
        y_tail = _normed(d_tail, rstd, weight_ptr, bias_ptr, tail, in_tail, dtype)
        amax = tl.maximum(amax, tl.max(tl.abs(y_tail), axis=0))
    scale = tl.maximum(amax, amax_floor) / fp8_max
    _store_e4m3(q_row, y_head, head, in_head, scale, fp8_max)
    if TAIL > 0:
        _store_e4m3(q_row, y_tail, tail, in_tail, scale, fp8_max)
    tl.store(scale_ptr + tl.program_id(0), scale)


def _launch_layer_norm_quantize(x, pending, summed, weight, bias, eps):
    m, n = x.shape
    q, scale = empty_quantized_rows(m, n, x.device)
    if m and n:
        _add_layer_norm_quantize_kernel[(m,)](
            x,
            x if pending is None else pending,
            x if summed is None else summed,
            weight,
            bias,
            q,
            scale,
            n,
            eps,
            AMAX_FLOOR,
            E4M3_MAX,
            HAS_PENDING=pending is not None,
            **_row_split(n),
        )
    return q, scale


@torch.library.custom_op("wicore::layer_norm_quantize", mutates_args=())
def layer_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] -> (e4m3 of LayerNorm(x) [M, N], float32 scale [M, 1])."""
    return _launch_layer_norm_quantize(x.contiguous(), None, None, weight, bias, eps)


@layer_norm_quantize.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("wicore::add_layer_norm_quantize", mutates_args=())
def add_layer_norm_quantize(
    x: torch.Tensor, pending: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, pending [M, N] -> (x + pending, e4m3 of LayerNorm(x + pending) [M, N], float32 scale [M, 1])."""
    x, pending = x.contiguous(), pending.contiguous()
    summed = torch.empty_like(x)
    return summed, *_launch_layer_norm_quantize(x, pending, summed, weight, bias, eps)


@add_layer_norm_quantize.register_fake
def _(x: torch.Tensor, pending: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    return torch.empty_like(x), x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)
