"""`wicore bench kernels`: where the device's time goes on the caption workload, kernel by kernel.

The fast engine alone (no Redis: in the product path the device is busy 0.97-0.99 of the window,
so its work is the engine's), Gemma-3-4B's shape, each job one image, the caption prompt and
exactly `new_tokens` tokens. Warm-up images first (compiling, tuning, graphs), then `images`
captioned under torch.profiler with CUDA activity only: every kernel, memcpy and memset the
device ran, CUDA-graph replays included (CUPTI traces a graph's kernels one by one), read back
from the profiler's Chrome trace (`traceEvents`, `cat` kernel / gpu_memcpy / gpu_memset, `dur` in
microseconds, `args.stream`). Reported per image:

- by kind (`CATEGORIES`, the first pattern that matches a kernel's name);
- by stream: the tower runs on a side stream, prefill and decode on the main one, so the
  streams split vision from text;
- the busy time (the union of all intervals: streams overlap) against the wall;
- the roofline's compute time per image of each phase at the measured matmul ceiling.
The summing is `summarize_trace`, pure Python over the trace's events.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from wicore.bench.bench_images import make_images
from wicore.schemas import DEFAULT_PROMPT

# (kind, pattern searched in the kernel's name, case-insensitive); the first match wins, so the
# specific ones come before "GEMM" (cuDNN's and our kernels' names may say gemm or mma too).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("paged attention (Triton)", r"paged_attention"),
    ("FP8 attention's quantize passes", r"_amax_kernel|_pad_quantize_kernel|_requantize_kernel"),
    ("attention (cuDNN / flash / SDPA)", r"cudnn|sdpa|fmha|flash|attention"),
    ("norm / GELU + FP8 quantize (ours)", r"quantize_kernel"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|s\d+_mma|_mma_|scaled_mm|matmul"),
    ("fused elementwise / norms (Triton)", r"^triton_"),
    ("memcpy / memset", r"^memcpy|^memset|^\[memcpy|^\[memset"),
    ("copy / index / cat", r"copy|index|gather|scatter|cat|elementwise"),
    ("other", r""),
)
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_KERNELS = 25


@dataclass(frozen=True)
class KernelBench:
    workdir: Path
    images: int = 512
    warmup_images: int = 64
    new_tokens: int = 64
    batch_size: int = 384
    engine_options: dict = field(default_factory=dict)
    device: str = "cuda"
    model_dir: Path | None = None  # None: Gemma-3-4B's shape, seeded (made in workdir)


def category(name: str) -> str:
    for kind, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


@dataclass
class _Kernel:
    """One kernel name's device time: its kind, launches, microseconds, and those per stream."""

    kind: str
    count: int = 0
    us: float = 0.0
    streams: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def summarize_trace(events: list[dict], images: int, wall_s: float) -> dict:
    """Device events of a Chrome trace -> totals per kind, per stream and per kernel name (ms and ms
    an image), and the busy time (their union) against `wall_s`. Other events are skipped."""
    kernels: dict[str, _Kernel] = {}
    spans = []
    for event in events:
        if event.get("cat") not in DEVICE_EVENTS or event.get("ph") != "X":
            continue
        name, start, us = str(event.get("name", "")), float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        kernel = kernels.get(name) or kernels.setdefault(name, _Kernel(category(name)))
        kernel.count += 1
        kernel.us += us
        kernel.streams[str((event.get("args") or {}).get("stream", "?"))] += us
        spans.append((start, start + us))
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # kind -> [us, launches]
    by_stream: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # stream -> kind -> us
    for kernel in kernels.values():
        by_kind[kernel.kind][0] += kernel.us
        by_kind[kernel.kind][1] += kernel.count
        for stream, us in kernel.streams.items():
            by_stream[stream][kernel.kind] += us
    total_us = sum(us for us, _ in by_kind.values())
    busy_us = _union(spans)

    def ms(us: float) -> dict:
        return {"ms": round(us / 1e3, 3), "ms_per_image": round(us / 1e3 / images, 4)}

    def largest_first(items, size):
        return sorted(items, key=lambda item: -size(item[1]))

    return {
        "device_events": len(spans),
        "kernel_ms_per_image": round(total_us / 1e3 / images, 4),  # all streams summed
        "busy_ms_per_image": round(busy_us / 1e3 / images, 4),  # their union
        "busy_fraction": busy_us / 1e6 / wall_s if wall_s > 0 else None,
        "wall_ms_per_image": round(wall_s * 1e3 / images, 4),
        "by_kind": {
            kind: {**ms(us), "share": round(us / total_us, 4) if total_us else 0.0, "count": count}
            for kind, (us, count) in largest_first(by_kind.items(), lambda entry: entry[0])
        },
        "by_stream": {
            stream: {**ms(sum(split.values())), "by_kind": {k: ms(us) for k, us in largest_first(split.items(), float)}}
            for stream, split in largest_first(by_stream.items(), lambda split: sum(split.values()))
        },
        "top_kernels": [
            {
                "name": name[:160],
                "kind": kernel.kind,
                "count": kernel.count,
                **ms(kernel.us),
                "mean_us": round(kernel.us / kernel.count, 2),
                "streams": [stream for stream, _ in largest_first(kernel.streams.items(), float)],
            }
            for name, kernel in largest_first(kernels.items(), lambda kernel: kernel.us)[:TOP_KERNELS]
        ],
    }


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def run_kernel_profile(bench: KernelBench) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from wicore.bench.cache_bench import release, request, timed_generate
    from wicore.bench.caption_bench import device_name
    from wicore.bench.roofline import image_work, measure_ceilings
    from wicore.engines.base import EngineConfig
    from wicore.engines.fast import FastEngine
    from wicore.engines.options import FastOptions
    from wicore.models.gemma3 import make_gemma3_4b

    bench.workdir.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(bench.device)
    model_dir = bench.model_dir or make_gemma3_4b(bench.workdir / "gemma3-4b")
    paths = make_images(bench.workdir / "images", bench.warmup_images + bench.images)
    requests = [request(f"i{i}", path, DEFAULT_PROMPT, bench.new_tokens) for i, path in enumerate(paths)]
    warm, timed = requests[: bench.warmup_images], requests[bench.warmup_images :]
    config = EngineConfig(
        str(model_dir), device=bench.device, dtype="bfloat16", max_batch_size=bench.batch_size,
        options=FastOptions.parse(bench.engine_options),
    )  # fmt: skip
    engine = FastEngine(config)
    engine.generate(warm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_s, stats = timed_generate(engine, timed)
    release(engine)
    trace = bench.workdir / "kernels-trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    trace.unlink()

    prompt_tokens = stats.get("mean_prompt_tokens") or 281
    work = image_work(AutoConfig.from_pretrained(model_dir), prompt_tokens, bench.new_tokens)
    ideal = {  # compute at the measured bf16 matmul ceiling; FP8 GEMMs may go below it
        phase: round(flops / ceilings.matmul_flops * 1e3, 4)
        for phase, flops in (("vision", work.vision_flops), ("prefill", work.prefill_flops), ("decode", work.decode_flops))
    }  # fmt: skip
    return {
        "gpu": device_name(bench.device),
        "command": kernels_command(bench),
        "engine_options": bench.engine_options,
        "images": bench.images,
        "new_tokens": bench.new_tokens,
        "batch_size": bench.batch_size,
        "ceilings": ceilings.as_dict(),
        "images_per_s": bench.images / wall_s,
        "roofline_ms_per_image": {**ideal, "total": round(sum(ideal.values()), 4)},
        "mean_decode_batch": stats.get("mean_decode_batch"),
        "vision_graph_replays": stats.get("vision_graph_replays"),
        **summarize_trace(events, bench.images, wall_s),
        "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def kernels_command(bench: KernelBench) -> str:
    from wicore.bench.caption_bench import engine_option_words

    words = ["wicore bench kernels", f"--images {bench.images}", f"--batch-size {bench.batch_size}"]
    return " ".join(words + engine_option_words(bench.engine_options))


def write_kernel_profile(report: dict, folder: Path) -> list[Path]:
    """kernels-gemma3-4b-<dtype>-<gpu>.json and .png (ms an image by kind)."""
    from wicore.bench.plots import write_report
    from wicore.bench.report import gpu_slug

    dtype = "fp8" if report["engine_options"].get("gemm_dtype") == "fp8" else "bf16"
    stem = folder / f"kernels-gemma3-4b-{dtype}-{gpu_slug(report['gpu'])}"
    bars = {kind.split(" (")[0]: entry["ms_per_image"] for kind, entry in report["by_kind"].items()}
    title = f"device ms an image by kind ({dtype}; busy {report['busy_ms_per_image']:.2f} of {report['wall_ms_per_image']:.2f} wall)"
    return write_report(report, stem, title, bars, "ms an image")


def print_kernel_profile(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("kind", "ms an image", "share", "kernels", title=f"wicore bench kernels ({report['gpu']})")
    for kind, entry in report["by_kind"].items():
        table.add_row(kind, f"{entry['ms_per_image']:.3f}", f"{100 * entry['share']:.1f}%", str(entry["count"]))
    ideal = report["roofline_ms_per_image"]
    table.add_row(
        "all kernels (streams summed)", f"{report['kernel_ms_per_image']:.3f}", "", str(report["device_events"])
    )
    table.add_row(
        "busy (their union) / wall", f"{report['busy_ms_per_image']:.3f} / {report['wall_ms_per_image']:.3f}", "", ""
    )
    table.add_row(
        "roofline: vision / prefill / decode",
        f"{ideal['vision']:.2f} / {ideal['prefill']:.2f} / {ideal['decode']:.2f}",
        "",
        "",
    )
    console = Console()
    console.print(table)
    streams = Table("stream", "ms an image", "largest kinds", title="by stream")
    for stream, entry in report["by_stream"].items():
        largest = ", ".join(f"{kind} {v['ms_per_image']:.2f}" for kind, v in list(entry["by_kind"].items())[:3])
        streams.add_row(stream, f"{entry['ms_per_image']:.3f}", largest)
    console.print(streams)
