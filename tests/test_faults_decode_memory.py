"""Oversized images against a real worker process (the demo captioner on CPU, each engine): a
batch of eight 7000 x 7000 PNGs (small files, under the pixel limit) must be captioned
correctly with the worker's resident memory growing by at most its decode budget and
`HEADROOM_MB` at its peak, and given back after the batch; its decode processes, when it has
them, stay within the one budget together. A worker's peak is the kernel's own high-water mark
(VmHWM), reset just before the batch through /proc/PID/clear_refs; its decode processes' is
their resident memory summed, sampled every 10 ms."""

from __future__ import annotations

import contextlib
import io
import struct
import threading
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageDraw
from redis import Redis

from tests.fault_rig import Workers, audit, wait_all_ended
from tests.helpers import children_of, png_bytes
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
TIGHT_BUDGET = 256 * 2**20  # one such decode at a time: what two decode processes must share


def big_png() -> bytes:
    """A red square on black, 7000 x 7000: ~150 KB of PNG, 147 MB of RGB pixels."""
    image = Image.new("RGB", (SIDE, SIDE), (0, 0, 0))
    ImageDraw.Draw(image).rectangle([1000, 1000, SIDE - 1000, SIDE - 1000], fill=(255, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def with_text(png: bytes, text: bytes) -> bytes:
    """The same PNG with a tEXt chunk after its header: other bytes (another job), same pixels."""
    body = b"Comment\x00" + text
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    header_end = 8 + 25  # signature, IHDR
    return png[:header_end] + chunk + png[header_end:]


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
    png = big_png()
    return [with_text(png, b"%d" % n) for n in range(BATCH)]


def start_worker(workers: Workers, connection: Redis) -> tuple[int, Producer]:
    """The worker's pid, once its engine has run a first full batch of small images (what it
    allocates for a batch, it keeps)."""
    process = workers.start("big-images")
    producer = Producer(connection, model="democap")
    warm_up = producer.submit_many(Submission(png_bytes(n, (400, 300))) for n in range(BATCH))
    wait_all_ended(connection, warm_up, timeout=120)
    return process.pid, producer


def run_batch(connection: Redis, producer: Producer, images: list[bytes]) -> list[str]:
    """The batch's captions, once every job is audited finished."""
    ids = producer.submit_many(Submission(data) for data in images)
    wait_all_ended(connection, ids, timeout=240)
    queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
    assert audit(connection, ids, queues) == {"finished": BATCH}
    return [producer.result(job_id).text for job_id in ids]


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_a_batch_of_huge_pngs_keeps_the_worker_peak_within_its_decode_budget(tmp_path, images, engine):
    budget = DECODE_BUDGET_BYTES
    args = ["--engine", engine, "--batch-size", str(BATCH), "--max-queue-delay-ms", "3000"]
    env = {"WICORE_LOG_LEVEL": "INFO"}
    with EmbeddedRedis() as server, Workers(server.url, tmp_path / "logs", args, env) as workers:
        connection = Redis.from_url(server.url)
        pid, producer = start_worker(workers, connection)
        before = memory_kb(pid)
        reset_peak(pid)
        captions = run_batch(connection, producer, images)
        after = memory_kb(pid)
        assert workers.stop_all() == {"big-images": 0}
    peak_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    settled_mb = (after["VmRSS"] - before["VmRSS"]) / 1024
    print(
        f"\n{engine}, decode budget {budget >> 20} MiB: worker RSS {before['VmRSS'] / 1024:.0f} MB before, "
        f"peak +{peak_mb:.0f} MB, +{settled_mb:.0f} MB after"
    )
    assert set(captions) == {"a red square on a black background"}, captions
    assert peak_mb <= budget / 2**20 + HEADROOM_MB
    assert settled_mb <= SETTLED_GROWTH_MB


class ChildrenMemory(threading.Thread):
    """The most resident memory a process's children held together, sampled every 10 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.most_kb = pid, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.most_kb = max(self.most_kb, self.now_kb())

    def now_kb(self) -> int:
        total = 0
        for child in children_of(self.pid):
            with contextlib.suppress(OSError, KeyError):  # gone meanwhile
                total += memory_kb(child)["VmRSS"]
        return total


def test_decode_processes_share_one_budget(tmp_path, images):
    args = ["--engine", "fast", "--batch-size", str(BATCH), "--max-queue-delay-ms", "3000", "--decode-processes", "2"]
    env = {"WICORE_LOG_LEVEL": "INFO", "WICORE_DECODE_BUDGET_BYTES": str(TIGHT_BUDGET)}
    with EmbeddedRedis() as server, Workers(server.url, tmp_path / "logs", args, env) as workers:
        connection = Redis.from_url(server.url)
        pid, producer = start_worker(workers, connection)
        sampler = ChildrenMemory(pid)
        sampler.start()
        captions = run_batch(connection, producer, images)
        sampler.done.set()
        sampler.join()
        idle_kb = sampler.now_kb()  # every process started, its decodes' memory given back
        assert workers.stop_all() == {"big-images": 0}
    peak_mb = (sampler.most_kb - idle_kb) / 1024
    print(
        f"\n2 decode processes, budget {TIGHT_BUDGET >> 20} MiB: together {idle_kb / 1024:.0f} MB idle, peak +{peak_mb:.0f} MB"
    )
    assert set(captions) == {"a red square on a black background"}, captions
    assert peak_mb <= TIGHT_BUDGET / 2**20 + HEADROOM_MB
