"""Where the fast engine's GPU time goes, on the Gemma-3-4B shape (GPU machine only).

    python bench/profile_fast.py OUT_DIR

1. torch.profiler over engine.generate() of 256 images: CUDA time per kernel, summed (this is
   independent of how the streams overlap).
2. Each phase alone, timed with CUDA events: the vision tower (batch 32), a packed prefill of 32
   prompts, a decode graph replay at batch 256 over real pages.
3. Contention: decode replays while the vision tower runs on the side stream.
4. The vision tower under torch.compile (default inductor mode).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from wicore.bench.images import make_images
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.models.gemma3 import make_gemma3_4b
from wicore.ops.attention import pack_layout
from wicore.ops.image import decode_image
from wicore.schemas import DEFAULT_PROMPT, GenerationParams


def timed(fn, repeat: int = 5, stream=None) -> float:
    """Median seconds of `fn` by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def requests(paths, n):
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_PROMPT}]}]
    params = GenerationParams(max_new_tokens=64, ignore_eos=True)
    return [EngineRequest(f"r{i}", chat, [decode_image(p.read_bytes())], params) for i, p in enumerate(paths[:n])]


def kernel_table(prof, top: int = 40) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        cuda_us = e.self_device_time_total
        if cuda_us > 0:
            rows.append({"name": e.key[:110], "cuda_ms": cuda_us / 1e3, "count": e.count})
    rows.sort(key=lambda r: -r["cuda_ms"])
    return rows[:top]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    model_dir = make_gemma3_4b("/tmp/prof/gemma3-4b")
    paths = make_images(Path("/tmp/prof/images"), 288, processes=16)
    t0 = time.perf_counter()
    engine = FastEngine(EngineConfig(str(model_dir), device="cuda", dtype="bfloat16", max_batch_size=256))
    report["engine_init_s"] = time.perf_counter() - t0
    runner = engine.runner
    engine.generate(requests(paths, 32))  # warm every path once

    reqs = requests(paths[32:], 256)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(reqs)
        torch.cuda.synchronize()
    report["generate_256_wall_s_profiled"] = time.perf_counter() - t0
    table = kernel_table(prof)
    report["kernels"] = table
    report["kernel_total_ms"] = sum(r["cuda_ms"] for r in kernel_table(prof, 10_000))
    report["stats_after_profile"] = engine.stats()

    t0 = time.perf_counter()
    engine.generate(requests(paths[32:], 256))
    report["generate_256_wall_s"] = time.perf_counter() - t0

    size = runner.parts.config.vision_config.image_size
    pixels = torch.randn(32, 3, size, size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        report["vision_b32_ms_per_image"] = 1e3 * timed(lambda: runner.encode(pixels)) / 32
        report["prefill_32x281_ms_per_image"] = 1e3 * timed(lambda: prefill(runner, 32, 281)) / 32
        rows = torch.arange(256, device="cuda")
        positions = torch.full((256,), 320, device="cuda", dtype=torch.int64)
        graphs = runner.graphs
        graphs.rows[:256].copy_(rows)
        graphs.positions[:256].copy_(positions)
        replay = graphs.graphs[256].replay
        report["decode_b256_step_ms"] = 1e3 * timed(replay, 20)
        report["decode_b64_step_ms"] = 1e3 * timed(graphs.graphs[64].replay, 20)
        report["contention"] = contention(runner, pixels, replay)
        report["vision_compiled_default"] = compiled_vision(runner, pixels)
    print(json.dumps({k: v for k, v in report.items() if k != "stats_after_profile"}, indent=1))
    (out / "profile_fast.json").write_text(json.dumps(report, indent=1, default=str))


def prefill(runner, batch: int, length: int):
    lengths = [length] * batch
    n, groups = sum(lengths), len(runner.layout.groups)

    def dev(array):
        return torch.from_numpy(np.asarray(array, dtype=np.int64)).to("cuda")

    return runner.prefill_logits(
        ids=dev(np.ones(n)),
        positions=dev(np.concatenate([np.arange(k) for k in lengths])),
        slots=dev(np.zeros((groups, n))),
        image_rows=dev(np.zeros(0)),
        image_groups=dev(np.full((batch, length), -1)),
        last=dev(np.cumsum(lengths) - 1),
        layout=pack_layout(lengths, "cuda"),
    )


def contention(runner, pixels, replay) -> dict:
    """Vision on the side stream, 20 decode replays on the main stream, at once."""
    side, main = runner.side_stream, runner.main_stream
    torch.cuda.synchronize()
    v0, v1, d0, d1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    with torch.cuda.stream(side):
        v0.record(side)
        runner.encode(pixels)
        v1.record(side)
    with torch.cuda.stream(main):
        d0.record(main)
        for _ in range(20):
            replay()
        d1.record(main)
    torch.cuda.synchronize()
    return {"vision_ms": v0.elapsed_time(v1), "decode_20_steps_ms": d0.elapsed_time(d1)}


def compiled_vision(runner, pixels) -> dict:
    t0 = time.perf_counter()
    compiled = torch.compile(runner.parts.encoder, dynamic=False)
    with torch.inference_mode():
        compiled(pixels)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        per_image = 1e3 * timed(lambda: compiled(pixels)) / 32
    return {"compile_s": compile_s, "ms_per_image": per_image}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
