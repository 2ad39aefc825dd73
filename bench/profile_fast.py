"""Where the fast engine's GPU time goes, on the Gemma-3-4B shape (GPU machine only).

    python bench/profile_fast.py OUT_DIR

Each phase alone, timed with CUDA events (the vision tower at batch 32, a packed prefill of 32
prompts, decode graph replays over real pages), and 512 images end to end through the engine
with and without vision overlapping on a side stream. (The kernel-level table of the first
profile, in bench/NOTES.md, came from torch.profiler over engine.generate().)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from wicore.bench.bench_images import make_images
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.models.gemma3 import make_gemma3_4b
from wicore.ops.attention import pack_layout
from wicore.ops.image_decode import decode_image
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


def main(out: Path) -> None:
    """Compiled engine (the CUDA default): each phase alone, then 512 images end to end with
    vision overlapping prefill/decode on a side stream, and with one stream for everything."""
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    model_dir = make_gemma3_4b("/tmp/prof/gemma3-4b")
    paths = make_images(Path("/tmp/prof/images"), 576, processes=16)
    for overlap in (True, False):
        t0 = time.perf_counter()
        options = {"overlap_vision": overlap}
        engine = FastEngine(
            EngineConfig(str(model_dir), device="cuda", dtype="bfloat16", max_batch_size=384, options=options)
        )
        run = {"engine_init_s": time.perf_counter() - t0}
        engine.generate(requests(paths, 64))  # warm every path once
        reqs = requests(paths[64:], 512)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(reqs)
        run["generate_512_s"] = time.perf_counter() - t0
        run["images_per_s"] = 512 / run["generate_512_s"]
        stats = engine.stats()
        run.update({k: stats[k] for k in ("vision_s", "prefill_s", "decode_s", "decode_steps", "mean_decode_batch")})
        if overlap:
            run.update(isolated(engine.runner))
        report[f"overlap_{overlap}"] = run
        print(json.dumps(run, indent=1), flush=True)
        engine.close()
        del engine
        torch.cuda.empty_cache()
    (out / "profile_fast.json").write_text(json.dumps(report, indent=1, default=str))


def isolated(runner) -> dict:
    size = runner.parts.config.vision_config.image_size
    pixels = torch.randn(32, 3, size, size, device="cuda", dtype=torch.bfloat16)
    result = {}
    with torch.inference_mode():
        result["vision_b32_ms_per_image"] = 1e3 * timed(lambda: runner.encode(pixels)) / 32
        result["prefill_32x281_ms_per_image"] = 1e3 * timed(lambda: prefill(runner, 32, 281)) / 32
        graphs = runner.decode_graphs
        graphs.columns[0].copy_(torch.arange(graphs.columns.shape[1], device="cuda") % runner.null_row)  # rows
        graphs.columns[1].fill_(320)  # positions
        for batch in (384, 256, 64):
            result[f"decode_b{batch}_step_ms"] = 1e3 * timed(graphs.graphs[batch].replay, 20)
    return result


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


if __name__ == "__main__":
    main(Path(sys.argv[1]))
