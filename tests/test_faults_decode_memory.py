"""Oversized images against a real worker process (the demo captioner on CPU, each engine): a
batch of eight 7000 x 7000 PNGs (small files, under the pixel limit) must be captioned
correctly with the worker's resident memory growing by at most its decode budget and
`HEADROOM_MB` at its peak, and given back after the batch. The peak is the kernel's own
high-water mark (VmHWM), reset just before the batch through /proc/PID/clear_refs."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image, ImageDraw
from redis import Redis

from tests.fault_rig import Workers, audit, wait_all_ended
from tests.helpers import png_bytes
from wicore.defaults import DECODE_BUDGET_BYTES
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, Submission

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SIDE = 7000  # 49 Mpx: under the default 50 Mpx limit
BATCH = 8
# One decode of such an image holds 196 MB (Pillow keeps RGB in 4 bytes a pixel): the budget
# lets as many run at once as fit in it, each shrunk at once to near the model's input size.
HEADROOM_MB = 64  # beside the budget: the shrunk images, the engine's batch
SETTLED_GROWTH_MB = 32  # what the worker keeps once the batch is done
TIGHT_BUDGET = 256 * 2**20  # one such decode at a time


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


@pytest.mark.parametrize(
    ("engine", "budget"),
    [("reference", DECODE_BUDGET_BYTES), ("fast", DECODE_BUDGET_BYTES), ("fast", TIGHT_BUDGET)],
)
def test_a_batch_of_huge_pngs_keeps_the_worker_peak_within_its_decode_budget(tmp_path, images, engine, budget):
    args = ["--engine", engine, "--batch-size", str(BATCH), "--max-queue-delay-ms", "3000"]
    env = {"WICORE_LOG_LEVEL": "INFO", "WICORE_DECODE_BUDGET_BYTES": str(budget)}
    with EmbeddedRedis() as server, Workers(server.url, tmp_path / "logs", args, env) as workers:
        connection = Redis.from_url(server.url)
        process = workers.start("big-images")
        producer = Producer(connection, model="democap")
        warm_up = producer.submit(png_bytes(0))  # the engine's first batch allocates for good
        wait_all_ended(connection, [warm_up], timeout=120)
        before = memory_kb(process.pid)
        reset_peak(process.pid)
        ids = producer.submit_many(Submission(data) for data in images)
        wait_all_ended(connection, ids, timeout=240)
        after = memory_kb(process.pid)
        queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
        statuses = audit(connection, ids, queues)
        captions = [producer.result(job_id).text for job_id in ids]
        assert workers.stop_all() == {"big-images": 0}
    peak_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    settled_mb = (after["VmRSS"] - before["VmRSS"]) / 1024
    print(
        f"\n{engine}, decode budget {budget >> 20} MiB: worker RSS {before['VmRSS'] / 1024:.0f} MB before, "
        f"peak +{peak_mb:.0f} MB, +{settled_mb:.0f} MB after"
    )
    assert statuses == {"finished": BATCH}, workers.log("big-images")[-3000:]
    assert set(captions) == {"a red square on a black background"}, captions
    assert peak_mb <= budget / 2**20 + HEADROOM_MB
    assert settled_mb <= SETTLED_GROWTH_MB
