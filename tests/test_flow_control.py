"""Flow control of bulk runs: `wicore caption --redis-url` and `wicore enqueue` keep a window of jobs
and image bytes in Redis, so Redis' memory peak stays near the window whatever the dataset's size
(a few hundred ~400 KB photos here against a window of a few MB), while `enqueue --no-window`
puts every image in Redis at once. Blobs leave Redis once no unfinished job uses them."""

from __future__ import annotations

import io
import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from redis import Redis

from tests.helpers import start_worker, stop, wicore
from wicore.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow
MODEL = "flow"
PHOTOS = 300
WINDOW = {"WICORE_WINDOW_JOBS": "16", "WICORE_WINDOW_BYTES": str(4 * 2**20)}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, int]:
    """PHOTOS noise PNGs of ~410 KB each (noise does not compress), and their total bytes."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for i in range(PHOTOS):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (370, 370, 3), dtype=np.uint8)).save(buffer, format="PNG")
        (folder / f"p{i:04d}.png").write_bytes(buffer.getvalue())
    return folder, sum(p.stat().st_size for p in folder.iterdir())


def memory(url: str) -> tuple[int, int]:
    """(used_memory, used_memory_peak) of the Redis at `url`."""
    info = Redis.from_url(url).info("memory")
    return info["used_memory"], info["used_memory_peak"]


def test_caption_keeps_redis_within_its_window(tmp_path, photos):
    folder, total = photos
    out = tmp_path / "out.jsonl"
    env = {**WINDOW, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with EmbeddedRedis() as server:
        start, _ = memory(server.url)
        wicore("caption", str(folder), "-o", str(out), "--redis-url", server.url, "--engine", "null", env=env)
        used, peak = memory(server.url)
        blobs = list(Redis.from_url(server.url).scan_iter("wicore:blob:*"))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == PHOTOS and {line["status"] for line in lines} == {"finished"}
    report(f"caption: {PHOTOS} photos, {total / 2**20:.0f} MiB; Redis peak {(peak - start) / 2**20:.1f} MiB over start")
    assert peak - start < total / 5, "Redis holds the window, not the dataset"
    assert used - start < 8 * 2**20 and len(blobs) <= 16, "the blobs of ended jobs leave Redis"


def test_enqueue_waits_past_its_window_and_fire_and_forget_does_not(tmp_path, photos):
    folder, total = photos
    with EmbeddedRedis() as server, ExitStack() as stack:
        worker = start_worker("--redis-url", server.url, "--engine", "null", "--model-id", MODEL,
                              "--max-queue-delay-ms", "0", log=tmp_path / "worker.log")  # fmt: skip
        stack.callback(stop, worker)
        start, _ = memory(server.url)
        windowed = wicore("enqueue", str(folder), "--redis-url", server.url, "--model-id", MODEL, env=WINDOW)
        _, peak = memory(server.url)
    assert len(windowed.stdout.splitlines()) == PHOTOS
    assert "waiting: more inputs than the window" in windowed.stderr
    assert peak - start < total / 5
    with EmbeddedRedis() as server:  # no worker: everything stays
        start, _ = memory(server.url)
        at_once = wicore("enqueue", str(folder), "--redis-url", server.url, "--model-id", MODEL, "--no-window")
        used, _ = memory(server.url)
    assert len(at_once.stdout.splitlines()) == PHOTOS and "waiting" not in at_once.stderr
    report(f"enqueue: windowed peak {(peak - start) / 2**20:.1f} MiB; --no-window {(used - start) / 2**20:.1f} MiB")
    assert used - start > total * 0.9, "fire and forget: every image is in Redis"


def report(line: str) -> None:
    print(line)


def test_bench_flow_reports_each_sides_redis_peak(tmp_path):
    done = wicore("bench", "flow", "--photos", "24", "--workdir", str(tmp_path), "--out", str(tmp_path), "--json")
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["photos"] == 24 and report["photo_bytes_total"] > 24 * 400_000
    for side in ("window", "unbounded"):
        assert report[f"{side}_lines"] == 24 and report[f"{side}_blobs_left"] == 0
        assert report[f"{side}_redis_peak_over_start_bytes"] > 0 and report[f"{side}_images_per_s"] > 0
    assert (tmp_path / "flow-null-24.json").exists()
