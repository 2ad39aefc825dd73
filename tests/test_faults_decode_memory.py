"""Oversized images against a real worker process (the demo captioner on CPU, each engine): a
batch of eight 7000 x 7000 PNGs (small files, under the pixel limit) must be captioned with the
worker's peak resident memory growing by at most `PEAK_GROWTH_MB`, and the memory given back
after the batch. The peak is the kernel's own high-water mark (VmHWM), reset just before the
batch through /proc/PID/clear_refs."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image, ImageDraw
from redis import Redis

from tests.fault_rig import Workers, audit, wait_all_ended
from tests.helpers import png_bytes
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, Submission

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SIDE = 7000  # 49 Mpx: under the default 50 Mpx limit
BATCH = 8
# Eight full decodes at once would be ~8 x 196 MB (Pillow keeps RGB in 4 bytes a pixel), and
# each converted or copied more than once. The decode budget lets one such image decode at a
# time, shrunk at once to near the model's input size.
PEAK_GROWTH_MB = 600
SETTLED_GROWTH_MB = 150  # what the worker keeps once the batch is done


def big_png(seed: int) -> bytes:
    """A 7000 x 7000 shape on a plain background: ~150 KB of PNG, 147 MB of RGB pixels."""
    image = Image.new("RGB", (SIDE, SIDE), (0, 0, 0))
    inset = 1000 + 50 * seed
    ImageDraw.Draw(image).rectangle([inset, inset, SIDE - inset, SIDE - inset], fill=(255, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid`, in kB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [big_png(seed) for seed in range(BATCH)]


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_a_batch_of_huge_pngs_keeps_the_worker_peak_bounded(tmp_path, images, engine):
    args = ["--engine", engine, "--batch-size", str(BATCH), "--max-queue-delay-ms", "3000"]
    with EmbeddedRedis() as server, Workers(server.url, tmp_path / "logs", args, {"WICORE_LOG_LEVEL": "INFO"}) as workers:
        connection = Redis.from_url(server.url)
        process = workers.start("big-images")
        producer = Producer(connection, model="democap")
        warm_up = producer.submit(png_bytes(0), "caption")  # the engine's first batch allocates for good
        wait_all_ended(connection, [warm_up], timeout=120)
        before = memory_kb(process.pid)
        reset_peak(process.pid)
        ids = producer.submit_many(Submission(data, "caption") for data in images)
        wait_all_ended(connection, ids, timeout=240)
        after = memory_kb(process.pid)
        queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
        statuses = audit(connection, ids, queues)
        assert workers.stop_all() == {"big-images": 0}
    peak_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    settled_mb = (after["VmRSS"] - before["VmRSS"]) / 1024
    print(f"\n{engine}: worker RSS {before['VmRSS'] / 1024:.0f} MB before, peak +{peak_mb:.0f} MB, +{settled_mb:.0f} MB after")
    assert statuses == {"finished": BATCH}, workers.log("big-images")[-3000:]
    assert peak_mb <= PEAK_GROWTH_MB
    assert settled_mb <= SETTLED_GROWTH_MB
