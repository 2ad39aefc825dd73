"""`torch.ops.wicore.fp8_attention` on CUDA (ops/fp8_attention.py says what it computes): imported
lazily, it needs triton and cuDNN's frontend (`nvidia-cudnn-frontend`, imported as `cudnn`).

Four launches, no host sync (so it runs inside CUDA graphs and as an opaque op under inductor):
1. `_scale_source_kernel`: the amax each part is scaled by: what the layer's `seen` holds, or on
   a first call (`seen` zero) max |q|, |k|, |v| over the batch (atomic max into 3 floats); with
   `seen` set its programs read `seen` (L2) and nothing of q, k and v;
2. `_pad_quantize_kernel`: q, k, v in e4m3 into one [3, batch, length, heads, padded] buffer,
   the padding written as zeros, raising `seen` to the maxima it meets; its first program also
   writes the scalars cuDNN takes;
3. cuDNN's FP8 SDPA forward over [batch, heads, length, padded] views of that buffer, O in e4m3
   in the same layout (a graph built once per shape, then executed on the current stream);
4. `_requantize_kernel`: O's real columns dequantized and quantized again per row.
cuDNN's kernel is most of the chain's device time; the whole chain takes less than bf16 SDPA
followed by the rowwise quantization.
"""

from __future__ import annotations

import atexit
import threading
import time

import cudnn
import torch
import triton
import triton.language as tl

from wicore.ops.fp8_format import AMAX_FLOOR, E4M3, E4M3_MAX, MARGIN, SEEN_SLOTS, padded_head_dim
from wicore.ops.fp8_triton import empty_quantized_rows

# One float32 buffer a call: the 3 amaxes the parts are scaled by, then the scalars cuDNN reads
# (written by the quantizing pass: descale_q, _k, _v, descale_s, scale_s, scale_o, in the order
# `_Plan.scalars` names them; O is dequantized by descale_v, as scale_o is 1 / descale_v), then 2
# amaxes cuDNN writes and nobody reads.
AMAXES, SCALARS, UNUSED = 3, 6, 2
AMAX_BLOCK = (64, 128)  # rows x columns the first call's amax pass reads at a time
AMAX_PROGRAMS = 528  # programs a part of that pass (4 per SM of a 132-SM Hopper GPU)
QUANTIZE_ROWS = 8  # rows a program of the quantizing pass takes through every head (faster than 16-64)
FINITE = tl.constexpr(3.0e38)  # past bf16's largest finite value (3.39e38) only inf and nan
REQUANTIZE_ROWS = 4  # rows a program of the requantizing pass takes (faster than 8)


@triton.jit
def _scale_source_kernel(
    qkv, seen, amax, rows, stride, width: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr, PROGRAMS: tl.constexpr,
):  # fmt: skip
    """Program (i < PROGRAMS, part): amax[part] = what seen[part] holds, written by the part's
    first program; while seen[part] is zero, every PROGRAMS-th row block from the i-th instead,
    atomic max of their |x|. A grid this small costs a few microseconds when there is nothing
    to read (a grid of one program a block costs several times that)."""
    part = tl.program_id(1)
    earlier = tl.max(tl.load(seen + part * SLOTS + tl.arange(0, SLOTS)), axis=0)
    end = tl.where(earlier > 0.0, 0, tl.cdiv(rows, BLOCK_M))
    largest = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for block in range(tl.program_id(0), end, PROGRAMS):
        r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        for start in range(0, width, BLOCK_C):
            c = start + tl.arange(0, BLOCK_C)
            inside = (r[:, None] < rows) & (c[None, :] < width)
            x = tl.load(qkv + r[:, None] * stride + part * width + c[None, :], mask=inside, other=0.0)
            largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
    value = tl.maximum(earlier, tl.max(tl.max(largest, axis=1), axis=0))
    tl.atomic_max(amax + part, value, mask=(earlier <= 0.0) | (tl.program_id(0) == 0), sem="relaxed")


@triton.jit
def _pad_quantize_kernel(
    qkv, out, amax, seen, scalars, rows, stride, part_stride, floor, fp8_max, margin, SLOTS: tl.constexpr,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row block, part): every head of q, k or v for BLOCK_M rows -> e4m3 [.., PADDED]
    at 448 / (margin * amax[part]), zeros past HEAD_DIM, into out [3, rows, HEADS, PADDED];
    seen[part] raised to the block's max |x| (in a slot by row block). The max is kept per
    element across heads and reduced once: a program a head with a reduction each was slower."""
    part = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    in_rows = r[:, None] < rows
    scale = fp8_max / (margin * tl.maximum(tl.load(amax + part), floor))
    largest = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for head in range(HEADS):
        x = tl.load(qkv + r[:, None] * stride + (part * HEADS + head) * HEAD_DIM + d[None, :],
                    mask=in_rows & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)  # fmt: skip
        largest = tl.maximum(largest, tl.where(tl.abs(x) <= FINITE, tl.abs(x), 0.0))  # inf and nan must not stick
        y = tl.clamp(x * scale, -fp8_max, fp8_max)
        tl.store(out + part * part_stride + (r[:, None] * HEADS + head) * PADDED + d[None, :],
                 y.to(out.dtype.element_ty), mask=in_rows & (d[None, :] < PADDED))  # fmt: skip
    block = tl.max(tl.max(largest, axis=1), axis=0)
    tl.atomic_max(seen + part * SLOTS + tl.program_id(0) % SLOTS, block, sem="relaxed")
    if tl.program_id(0) + tl.program_id(1) == 0:
        amax_q = margin * tl.maximum(tl.load(amax), floor)
        amax_k = margin * tl.maximum(tl.load(amax + 1), floor)
        amax_v = margin * tl.maximum(tl.load(amax + 2), floor)
        tl.store(scalars + 0, amax_q / fp8_max)
        tl.store(scalars + 1, amax_k / fp8_max)
        tl.store(scalars + 2, amax_v / fp8_max)
        tl.store(scalars + 3, 1.0 / fp8_max)  # probabilities <= 1 land on 448
        tl.store(scalars + 4, fp8_max)
        tl.store(scalars + 5, fp8_max / amax_v)  # |O| <= max |v|


@triton.jit
def _requantize_kernel(
    o, scalars, out, out_scale, rows, floor, fp8_max,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row block): rows of O [rows, HEADS, PADDED] (e4m3 at scale_o = 1 / descale_v) ->
    e4m3 [rows, HEADS * HEAD_DIM] at a scale per row, and the scales [rows, 1]."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_H * BLOCK_D)
    head, d = c // BLOCK_D, c % BLOCK_D
    inside = (r[:, None] < rows) & ((head < HEADS) & (d < HEAD_DIM))[None, :]
    x = tl.load(o + (r[:, None] * HEADS + head[None, :]) * PADDED + d[None, :], mask=inside, other=0.0)
    x = x.to(tl.float32) * tl.load(scalars + 2)  # descale_v undoes scale_o
    row_amax = tl.maximum(tl.max(tl.abs(x), axis=1), floor)
    y = tl.clamp(x * (fp8_max / row_amax)[:, None], -fp8_max, fp8_max)
    tl.store(out + r[:, None] * (HEADS * HEAD_DIM) + head[None, :] * HEAD_DIM + d[None, :], y.to(out.dtype.element_ty),
             mask=inside)  # fmt: skip
    tl.store(out_scale + r, row_amax / fp8_max, mask=r < rows)


class _Plan:
    """cuDNN's FP8 SDPA forward for one shape: q, k, v and O with dims [batch, heads, length,
    padded] over memory laid out [batch, length, heads, padded] (rows as the GEMM wrote them)."""

    def __init__(self, handle, batch: int, heads: int, length: int, head_dim: int):
        padded = padded_head_dim(head_dim)
        dims = [batch, heads, length, padded]
        strides = [length * heads * padded, padded, heads * padded, 1]
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.qkv = [graph.tensor(name=name, dim=dims, stride=strides, data_type=fp8) for name in "qkv"]
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        self.scalars = [graph.tensor(name=name, **scalar) for name in names]
        o, _stats, amax_s, amax_o = graph.sdpa_fp8(
            name="tower_attention", q=self.qkv[0], k=self.qkv[1], v=self.qkv[2], generate_stats=False,
            attn_scale=head_dim**-0.5, use_causal_mask=False, **dict(zip(names, self.scalars)),
        )  # fmt: skip
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp8)
        for amax in (amax_s, amax_o):  # required outputs of the FP8 forward; unused here
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.o, self.amaxes = graph, o, (amax_s, amax_o)
        self.padded, self.workspace = padded, max(1, graph.get_workspace_size())


_lock = threading.Lock()
_handles: dict[int, object] = {}
_plans: dict[tuple, _Plan] = {}


@atexit.register
def _release() -> None:
    """Drop the cuDNN graphs and handles before the interpreter tears the bindings down (objects
    still alive then make nanobind print pages of leak warnings at every exit)."""
    with _lock:
        _plans.clear()
        _handles.clear()


def _plan(device: torch.device, batch: int, heads: int, length: int, head_dim: int) -> tuple[object, _Plan]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, batch, heads, length, head_dim)
    with _lock:
        if index not in _handles:
            with torch.cuda.device(index):
                _handles[index] = cudnn.create_handle()
        if key not in _plans:
            with torch.cuda.device(index):
                _plans[key] = _Plan(_handles[index], batch, heads, length, head_dim)
        return _handles[index], _plans[key]


def prepare(device: torch.device, batches: list[int], heads: int, length: int, head_dim: int) -> float:
    """Build the plans of these batch sizes now; returns the seconds it took. A plan takes cuDNN
    ~0.1 s of host: built inside the first batch of each size, it leaves the device idle."""
    start = time.perf_counter()
    for batch in batches:
        _plan(device, batch, heads, length, head_dim)
    return time.perf_counter() - start


@torch.library.custom_op("wicore::fp8_attention", mutates_args=("seen",))
def fp8_attention(
    qkv: torch.Tensor, batch: int, heads: int, head_dim: int, seen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [rows, 3 * heads * head_dim] -> (e4m3 [rows, heads * head_dim], float32 scale [rows, 1]);
    seen [3, SEEN_SLOTS] raised to this call's max |q|, |k|, |v|."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    rows, width = qkv.shape[0], heads * head_dim
    device = qkv.device
    out, out_scale = empty_quantized_rows(rows, width, device)
    if rows == 0:
        return out, out_scale
    handle, plan = _plan(device, batch, heads, rows // batch, head_dim)
    padded = plan.padded
    floats = torch.zeros(AMAXES + SCALARS + UNUSED, dtype=torch.float32, device=device)
    amax, scalars, unused_amaxes = floats.split((AMAXES, SCALARS, UNUSED))
    qkv8 = torch.empty((3, rows, heads, padded), dtype=E4M3, device=device)
    o8 = torch.empty((rows, heads, padded), dtype=E4M3, device=device)
    block_m, block_c = AMAX_BLOCK
    _scale_source_kernel[(AMAX_PROGRAMS, 3)](
        qkv, seen, amax, rows, qkv.stride(0), width, SLOTS=SEEN_SLOTS, BLOCK_M=block_m, BLOCK_C=block_c,
        PROGRAMS=AMAX_PROGRAMS,
    )  # fmt: skip
    _pad_quantize_kernel[(triton.cdiv(rows, QUANTIZE_ROWS), 3)](
        qkv, qkv8, amax, seen, scalars, rows, qkv.stride(0), qkv8[0].numel(), AMAX_FLOOR, E4M3_MAX, MARGIN, SLOTS=SEEN_SLOTS,
        HEADS=heads, HEAD_DIM=head_dim, PADDED=padded, BLOCK_M=QUANTIZE_ROWS, BLOCK_D=triton.next_power_of_2(padded),
    )  # fmt: skip
    pack = {plan.qkv[i]: qkv8[i] for i in range(3)}
    pack.update({tensor: scalars[i : i + 1] for i, tensor in enumerate(plan.scalars)})
    pack.update({plan.o: o8, plan.amaxes[0]: unused_amaxes[0:1], plan.amaxes[1]: unused_amaxes[1:2]})
    workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    plan.graph.execute(pack, workspace, handle=handle)
    _requantize_kernel[(triton.cdiv(rows, REQUANTIZE_ROWS),)](
        o8, scalars, out, out_scale, rows, AMAX_FLOOR, E4M3_MAX, HEADS=heads, HEAD_DIM=head_dim, PADDED=padded,
        BLOCK_M=REQUANTIZE_ROWS, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(padded),
    )  # fmt: skip
    return out, out_scale


@fp8_attention.register_fake
def _(
    qkv: torch.Tensor, batch: int, heads: int, head_dim: int, seen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = qkv.shape[0]
    return qkv.new_empty((rows, heads * head_dim), dtype=E4M3), qkv.new_empty((rows, 1), dtype=torch.float32)
