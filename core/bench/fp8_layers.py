"""`wicore bench fp8-layers`: what FP8 GEMMs buy per layer at Gemma-3-4B's shapes, before the whole
caption benchmark. Times, bf16 against FP8 rowwise (the engine's: a scale per output channel and
per token) and FP8 tensorwise (one scale each):

- each distinct GEMM alone (the matmul on already-quantized inputs; FP8 rowwise also with exact
  accumulation, and with the activation quantization included, eager);
- one vision-tower layer (norms, q/k/v, cuDNN attention, MLP) on 16 images (65,536 patch rows),
  and its rowwise FP8 form also with the norms left to inductor instead of the one-pass kernel;
- one decoder layer's dense part (norms, q/k/v, QK-norm, RoPE, o, gate/up, down, residuals;
  attention left out) at a packed prefill's 18,048 rows and a decode step's 384;
eager and compiled as the engine compiles them. CUDA events, the median of `repeats`. Weights are
seeded at nn.Linear's default scale: GEMM speed depends on shapes, not on values.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from wicore.engines.fast.model.fp8 import FP8Report, quantize_decoder_layer, quantize_vision_layer
from wicore.engines.fast.model.layers import GemmaRMSNorm
from wicore.engines.fast.model.text_decoder import DecoderLayer, LayerFunctions, rope, rope_inv_freq
from wicore.engines.fast.model.vision_tower import SiglipLayer
from wicore.ops.fp8 import fp8_linear, quantize, quantize_weight, scaled_mm

VARIANTS = {"bf16": None, "fp8": True, "fp8_tensorwise": False}  # name -> rowwise (None: not quantized)
UNFUSED_NORMS = "fp8_unfused_norms"  # the vision layer's rowwise FP8 with its norms and quantization left to inductor


@dataclass(frozen=True)
class Shapes:
    images: int = 16  # vision rows = images x patches
    prefill_rows: int = 18_048  # a full packed prefill: 64 prompts of ~282 tokens
    decode_rows: int = 384  # the caption benchmark's decode batch


def run_fp8_layers(config, device: str = "cuda", shapes: Shapes = Shapes(), compile: bool = True, repeats: int = 20):
    """The report (JSON-able) for a Gemma3Config's vision and text shapes."""
    torch.manual_seed(0)
    vision, text = config.vision_config, config.text_config
    with torch.inference_mode():
        return {
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "shapes": shapes.__dict__,
            "gemms": gemm_table(gemm_shapes(vision, text, shapes), device, repeats),
            "vision_layer": vision_layer(vision, shapes.images, device, compile, repeats),
            "decoder_dense": decoder_dense(text, (shapes.prefill_rows, shapes.decode_rows), device, compile, repeats),
        }


def gemm_shapes(vision, text, shapes: Shapes) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of every GEMM the FP8 mode quantizes."""
    rows = shapes.images * (vision.image_size // vision.patch_size) ** 2
    h, i = vision.hidden_size, vision.intermediate_size
    th, attn = text.hidden_size, text.num_attention_heads * text.head_dim
    qkv = attn + 2 * text.num_key_value_heads * text.head_dim
    named = [("vision qkv", rows, 3 * h, h), ("vision out", rows, h, h), ("vision fc1", rows, i, h)]
    named.append(("vision fc2", rows, h, i))
    for phase, m in (("prefill", shapes.prefill_rows), ("decode", shapes.decode_rows)):
        named += [(f"{phase} qkv", m, qkv, th), (f"{phase} o", m, th, attn)]
        named += [
            (f"{phase} gate_up", m, 2 * text.intermediate_size, th),
            (f"{phase} down", m, th, text.intermediate_size),
        ]
    return named


def gemm_table(named: list[tuple[str, int, int, int]], device: str, repeats: int) -> list[dict]:
    return [gemm_row(name, m, n, k, device, repeats) for name, m, n, k in named]


def gemm_row(name: str, m: int, n: int, k: int, device: str, repeats: int) -> dict:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16)
    rowwise, tensorwise = quantize_weight(w), quantize_weight(w, rowwise=False)
    x_q, x_scale = quantize(x)
    xt_q, xt_scale = quantize(x, rowwise=False)
    runs = {
        "bf16": partial(F.linear, x, w),
        "fp8": partial(scaled_mm, x_q, x_scale, rowwise, None, x.dtype, True),
        "fp8_exact_accum": partial(scaled_mm, x_q, x_scale, rowwise, None, x.dtype, False),
        "fp8_tensorwise": partial(scaled_mm, xt_q, xt_scale, tensorwise, None, x.dtype, True),
        "fp8_with_quantize": partial(fp8_linear, x, rowwise),
    }
    ms = {key: time_ms(run, device, repeats) for key, run in runs.items()}
    row = {"gemm": name, "m": m, "n": n, "k": k} | {f"{key}_ms": round(t, 4) for key, t in ms.items()}
    return row | {f"{key}_tflops": round(2 * m * n * k / t / 1e9, 1) for key, t in ms.items()}


def vision_layer(vision, images: int, device: str, compile: bool, repeats: int) -> dict:
    patches = (vision.image_size // vision.patch_size) ** 2
    x = torch.randn(images, patches, vision.hidden_size, device=device, dtype=torch.bfloat16)
    times = {}
    for name, rowwise in (VARIANTS | {UNFUSED_NORMS: True}).items():
        with torch.device(device):
            layer = SiglipLayer(vision).to(torch.bfloat16).eval()
        if rowwise is not None:
            layer = quantize_vision_layer(layer, FP8Report(), "probe", rowwise, fuse_norms=name != UNFUSED_NORMS)
        times[f"{name}_eager_ms"] = time_ms(partial(layer, x), device, repeats)
        if compile:
            times[f"{name}_compiled_ms"] = time_ms(partial(torch.compile(layer, dynamic=False), x), device, repeats)
    return {"rows": images * patches} | speedups(times)


def decoder_dense(text, row_counts: tuple[int, ...], device: str, compile: bool, repeats: int) -> dict:
    inputs = {rows: _decoder_inputs(text, rows, device) for rows in row_counts}
    times = {}
    for name, rowwise in VARIANTS.items():
        layer = _decoder_layer(text, device, rowwise)
        for mode, fns in _layer_functions(compile).items():
            for rows, (x, cos, sin) in inputs.items():
                run = partial(layer, x, cos, sin, _no_attention, fns)
                times[f"{name}_{mode}_{rows}_rows_ms"] = time_ms(run, device, repeats)
    return speedups(times)


def _layer_functions(compile: bool) -> dict[str, LayerFunctions]:
    modes = {"eager": LayerFunctions()}
    if compile:
        modes["compiled"] = LayerFunctions()
        modes["compiled"].compile()
    return modes


def _decoder_layer(text, device: str, rowwise: bool | None) -> DecoderLayer:
    with torch.device(device):
        layer = DecoderLayer(text, 0).to(torch.bfloat16).eval()
    for norm in (m for m in layer.modules() if isinstance(m, GemmaRMSNorm)):
        norm.weight.data.zero_()  # allocated uninitialised (weights load by assignment): (1 + 0) scaling
    layer.fuse_weights()
    if rowwise is not None:
        quantize_decoder_layer(layer, FP8Report(), rowwise)
    return layer


def _decoder_inputs(text, rows: int, device: str):
    x = torch.randn(rows, text.hidden_size, device=device, dtype=torch.bfloat16)
    inv_freq = rope_inv_freq(text, text.layer_types[0]).to(device)
    return (x, *rope(torch.arange(rows, device=device) % 4096, inv_freq, torch.bfloat16))


def _no_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q  # [N, Hq, D]: the dense part alone, with its data dependency kept


def speedups(times: dict[str, float]) -> dict:
    """The times, rounded, and bf16 time / FP8 time for each FP8 entry."""
    out = {key: round(t, 3) for key, t in times.items()}
    for key, t in times.items():
        if key.startswith("fp8"):
            out[key.replace("_ms", "_speedup")] = round(
                times[re.sub(r"^fp8(_tensorwise|_unfused_norms)?", "bf16", key)] / t, 3
            )
    return out


def time_ms(fn: Callable, device: str, repeats: int) -> float:
    """Median milliseconds of `fn` (CUDA events on CUDA), after two warm-up calls."""
    for _ in range(2):
        fn()
    if not device.startswith("cuda"):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return sorted(samples)[len(samples) // 2]
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[repeats // 2]


def write_fp8_layers(report: dict, folder: Path) -> Path:
    """fp8-layers-<gpu>.json."""
    from wicore.bench.report import gpu_slug

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"fp8-layers-{gpu_slug(report['gpu'])}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def print_fp8_layers(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    gemms = Table("GEMM", "M x N x K", "bf16 TFLOP/s", "FP8 TFLOP/s", "FP8 / bf16", "+ quantize", "exact accum",
                  "tensorwise", title=f"FP8 GEMMs at Gemma-3-4B's shapes ({report['gpu']}, torch {report['torch']})")  # fmt: skip
    for row in report["gemms"]:
        ratio = {key: f"{row['bf16_ms'] / row[f'{key}_ms']:.2f}x" for key in GEMM_RATIOS}
        shape = f"{row['m']} x {row['n']} x {row['k']}"
        gemms.add_row(row["gemm"], shape, f"{row['bf16_tflops']:.0f}", f"{row['fp8_tflops']:.0f}", *ratio.values())
    layers = Table("layer", "time (ms)", "bf16", "FP8", "FP8 / bf16", "tensorwise / bf16", title="one layer")
    vision = f"vision, {report['shapes']['images']} images"
    for name, times in ((vision, report["vision_layer"]), ("decoder dense", report["decoder_dense"])):
        for key in (k for k in times if k.startswith("bf16_")):
            rest = key.removeprefix("bf16_").removesuffix("_ms")
            cells = (
                times[key],
                times[f"fp8_{rest}_ms"],
                times[f"fp8_{rest}_speedup"],
                times[f"fp8_tensorwise_{rest}_speedup"],
            )
            layers.add_row(name, rest, *(f"{cell:.3f}" for cell in cells))
    vision = report["vision_layer"]
    unfused = [
        f"{key.split('_')[-2]} {vision[key]:.3f} ms"
        for key in vision
        if key.startswith(UNFUSED_NORMS) and key.endswith("_ms")
    ]
    Console().print(gemms, layers, f"vision layer, FP8 with inductor's norms: {', '.join(unfused)}")


GEMM_RATIOS = ("fp8", "fp8_with_quantize", "fp8_exact_accum", "fp8_tensorwise")  # bf16 time / their time
