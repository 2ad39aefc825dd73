"""`wicore bench flow` (and `wicore bench caption --compare-window`): `wicore caption --redis-url`
over many ~420 KB photos, each side on a fresh redis-server of its own, with the flow-control
window at its default and unbounded (every input submitted at once), in the same run. Per side:
Redis' `used_memory` peak over its start (sampled, and INFO's own peak), images/s once the workers
were ready (caption's summary), the blobs left at the end. Each side has a cache folder of its own
(the engine's caches on, as `wicore caption` runs them, but nothing carried from one side to the other).

    report = run_flow_bench(FlowBench(Path("/tmp/wicore-bench/flow"), photos=5000))
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

PHOTO_SIDE = 370  # 370 x 370 RGB, stored uncompressed: ~411 KB a photo
UNBOUNDED = {"WICORE_WINDOW_JOBS": str(10**9), "WICORE_WINDOW_BYTES": "0"}
_RATE = re.compile(r"([\d.]+) images/s once the workers were ready")


@dataclass(frozen=True)
class FlowBench:
    workdir: Path
    photos: int = 5000
    engine: str = "null"
    caption_args: tuple[str, ...] = ()  # more `wicore caption` flags (model, device, batch size)
    unbounded: bool = True  # also the side without a window
    env: dict[str, str] = field(default_factory=dict)  # settings of both sides (WICORE_WINDOW_JOBS, ...)


def make_photos(folder: Path, count: int) -> int:
    """`count` distinct ~411 KB PNGs (noise, stored uncompressed: cheap to write, and each its own
    blob); kept between runs. Returns their total bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    base = np.random.default_rng(0).integers(0, 255, (PHOTO_SIDE, PHOTO_SIDE, 3), dtype=np.uint8)
    for i in range(count):
        path = folder / f"p{i:06d}.png"
        if not path.exists():
            pixels = base.copy()
            pixels[0, :3, :] = np.frombuffer(i.to_bytes(9, "big"), dtype=np.uint8).reshape(3, 3)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG", compress_level=0)
            path.write_bytes(buffer.getvalue())
    return sum(folder.joinpath(f"p{i:06d}.png").stat().st_size for i in range(count))


class MemorySampler(threading.Thread):
    """Redis' used_memory every `every_s` while running; `peak` is the highest seen."""

    def __init__(self, url: str, every_s: float = 0.2):
        from redis import Redis

        super().__init__(name="memory-sampler", daemon=True)
        self.connection = Redis.from_url(url)
        self.every_s = every_s
        self.peak = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            self.peak = max(self.peak, int(self.connection.info("memory")["used_memory"]))

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=10)
        return self.peak


def caption_command(bench: FlowBench, folder: Path, out: Path, url: str) -> list[str]:
    args = [str(folder), "-o", str(out), "--redis-url", url, "--engine", bench.engine]
    return [sys.executable, "-m", "wicore.cli.main", "caption", *args, *bench.caption_args]


def run_side(bench: FlowBench, folder: Path, name: str, env: dict[str, str]) -> dict:
    """One `wicore caption --redis-url` run on a fresh redis-server, sampled."""
    from redis import Redis

    from wicore.embedded import EmbeddedRedis

    out = bench.workdir / f"{name}.jsonl"
    out.unlink(missing_ok=True)
    cache = bench.workdir / f"cache-{name}"  # a side's own, emptied: no side reads what the other cached
    shutil.rmtree(cache, ignore_errors=True)
    with EmbeddedRedis() as server:
        connection = Redis.from_url(server.url)
        start = int(connection.info("memory")["used_memory"])
        sampler = MemorySampler(server.url)
        sampler.start()
        began = time.perf_counter()
        done = subprocess.run(
            caption_command(bench, folder, out, server.url),
            env={**os.environ, "WICORE_CACHE_DIR": str(cache), **bench.env, **env},
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        wall = time.perf_counter() - began
        sampled = sampler.stop()
        info = connection.info("memory")
        blobs_left = sum(1 for _ in connection.scan_iter("wicore:blob:*", count=1000))
    if done.returncode != 0:
        raise RuntimeError(f"wicore caption ({name}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    rate = _RATE.search(done.stdout + done.stderr)
    return {
        "settings": {**bench.env, **env} or "defaults",
        "wall_s": round(wall, 1),
        "images_per_s": float(rate.group(1)) if rate else None,
        "redis_peak_over_start_bytes": max(sampled, int(info["used_memory_peak"])) - start,
        "redis_sampled_peak_over_start_bytes": sampled - start,
        "redis_used_at_end_over_start_bytes": int(info["used_memory"]) - start,
        "blobs_left": blobs_left,
        "lines": sum(1 for _ in out.open()),
    }


def run_flow_bench(bench: FlowBench) -> dict:
    bench.workdir.mkdir(parents=True, exist_ok=True)
    folder = bench.workdir / f"photos-{bench.photos}"
    total = make_photos(folder, bench.photos)
    sides = {"window": run_side(bench, folder, "window", {})}
    if bench.unbounded:
        sides["unbounded"] = run_side(bench, folder, "unbounded", UNBOUNDED)
    report = {
        "photos": bench.photos,
        "photo_bytes_total": total,
        "engine": bench.engine,
        "caption_args": list(bench.caption_args),
        **{f"{name}_{key}": value for name, side in sides.items() for key, value in side.items()},
    }
    if bench.unbounded and sides["window"]["images_per_s"] and sides["unbounded"]["images_per_s"]:
        report["window_vs_unbounded_images_per_s"] = round(
            sides["window"]["images_per_s"] / sides["unbounded"]["images_per_s"], 3
        )
    return report


def write_flow_report(report: dict, out: Path, name: str) -> list[Path]:
    """<name>.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return [path]
