"""Decode processes (`wicore.ops.pixel_pool`): the same pixels and the same error lines as loading
in this process, for good images and bad ones; real processes killed with real signals lose no
job, and an image that kills its process fails alone."""

from __future__ import annotations

import hashlib
import io
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.fault_corpus import encoded, odd_images, png_header_only
from tests.helpers import children_of, wait_until
from wicore.ops.image_load import ImageSource, LoadRules, load_pixels
from wicore.ops.image_preprocess import PreprocessSpec
from wicore.ops.pixel_pool import PixelPool

SPEC = PreprocessSpec(size=(32, 32), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def blob(data: bytes) -> ImageSource:
    return ImageSource(hashlib.sha256(data).hexdigest(), data=data)


def decode_processes() -> list[int]:
    """This process's decode processes (not multiprocessing's resource tracker)."""
    return [pid for pid in children_of(os.getpid()) if b"spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def resident_mb(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError):
        return 0.0


def sources(tmp_path: Path) -> list[ImageSource]:
    """Good images of every kind, and one of each way an input goes wrong."""
    rng = random.Random(0)
    good = [encoded(rng, fmt, (rng.randint(20, 90), rng.randint(20, 90))) for fmt in ("PNG", "JPEG", "WEBP")]
    good += odd_images(rng)[::3]
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "good.png").write_bytes(good[0])
    (allowed / "folder").mkdir()
    bad = [rng.randbytes(300), good[1][: len(good[1]) // 2], png_header_only(60_000, 60_000)]
    return [blob(data) for data in good + bad] + [
        ImageSource(hashlib.sha256(b"other").hexdigest(), data=good[2]),  # not the bytes' hash
        ImageSource(hashlib.sha256(good[0]).hexdigest(), path=str(allowed / "good.png")),
        ImageSource(hashlib.sha256(good[0]).hexdigest(), path=str(tmp_path / "outside.png")),
        ImageSource("0" * 64, path=str(allowed / "missing.png")),
        ImageSource("0" * 64, path=str(allowed / "folder")),
        ImageSource("0" * 64, path=str(allowed / "bad\x00name.png")),
    ]


def test_processes_give_the_pixels_and_error_lines_of_loading_here(tmp_path):
    rules = LoadRules((tmp_path / "allowed",))
    inputs = sources(tmp_path)
    pool = PixelPool(2, SPEC, rules)
    try:
        landed = [future.result(timeout=120) for future in [pool.submit(source) for source in inputs]]
    finally:
        pool.close()
    here = [load_pixels(source, rules, SPEC) for source in inputs]
    for (pixels, error, _, _), (want_pixels, want_error, _, _) in zip(landed, here, strict=True):
        assert error == want_error
        assert (pixels is None and want_pixels is None) or np.array_equal(pixels, want_pixels)
    errors = [result.error.split(":")[0] for result in landed if result.error]
    assert errors == ["ImageError", "ImageError", "ImageTooLarge", "ImageError"] + ["ImageNotAllowed"] + [
        "ImageError",
        "ImageError",
        "ImageNotAllowed",
    ]
    good = [result.pixels for result in landed if not result.error]
    assert len(good) == len(inputs) - 8 and all(p.shape == (32, 32, 3) and p.dtype == np.uint8 for p in good)


def test_then_runs_on_the_result_and_close_cancels_what_has_not_run(tmp_path):
    data = encoded(random.Random(1), "PNG", (50, 40))
    pool = PixelPool(1, SPEC, LoadRules())
    shapes = [pool.submit(blob(data), lambda result: result[0].shape) for _ in range(12)]
    assert shapes[0].result(timeout=120) == (32, 32, 3)
    pool.close()
    wait_until(lambda: all(f.done() for f in shapes), 60, what="every future to end")
    assert all(f.cancelled() or f.result() == (32, 32, 3) for f in shapes)


@pytest.mark.faults
def test_killing_the_decode_processes_loses_no_image():
    rng = np.random.default_rng(0)
    photos = []
    for _ in range(12):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (1500, 2000, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        photos.append(buffer.getvalue())
    pool = PixelPool(2, SPEC, LoadRules())
    try:
        futures = [pool.submit(blob(data)) for data in photos]
        wait_until(lambda: len(decode_processes()) == 2, 60, what="two decode processes")
        first = decode_processes()
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        results = [future.result(timeout=120) for future in futures]
        assert [result.error for result in results] == [""] * len(photos), "every image ran again"
        for (pixels, _, _, _), data in zip(results, photos, strict=True):
            assert np.array_equal(pixels, load_pixels(blob(data), LoadRules(), SPEC)[0])
        assert pool.submit(blob(photos[0])).result(timeout=60)[1] == "", "the pool works after"
        assert not set(decode_processes()) & set(first), "new processes"
    finally:
        pool.close()


@pytest.mark.faults
def test_an_image_whose_process_dies_twice_fails_alone_and_its_batch_mates_run():
    """The image runs with another when its process is killed, then alone, and is killed again:
    it ends with an ImageError line; the image beside it and the one queued behind succeed."""
    buffer = io.BytesIO()
    Image.new("RGB", (7000, 7000), (10, 20, 30)).save(buffer, format="PNG", compress_level=1)  # ~150 MB decoded
    heavy = blob(buffer.getvalue())
    light = [blob(encoded(random.Random(seed), "PNG", (64, 48))) for seed in range(2)]
    pool = PixelPool(1, SPEC, LoadRules())
    try:
        futures = [pool.submit(source) for source in [heavy, *light]]
        killed: list[int] = []  # a killed process can linger in /proc, still that large, for a while

        def found_heavy() -> bool:  # while the heavy image is decoded: it alone holds that much memory
            heavy = [p for p in decode_processes() if p not in killed and resident_mb(p) > 100]
            killed.extend(heavy[:1])
            return bool(heavy)

        for _ in range(2):
            wait_until(found_heavy, 120, 0.005, what="decoding")
            os.kill(killed[-1], signal.SIGKILL)
        pixels, error, _, _ = futures[0].result(timeout=120)
        assert pixels is None and error.startswith("ImageError: the image decoding process died on this image")
        for future, source in zip(futures[1:], light, strict=True):
            assert np.array_equal(future.result(timeout=120)[0], load_pixels(source, LoadRules(), SPEC)[0])
    finally:
        pool.close()


def test_urls_are_fetched_in_the_decode_processes_and_hashed_there():
    """The sha256 of a URL's image is known only after its fetch: it comes back with the pixels.
    A URL that fails (404, a server that never answers) is that task's error line alone."""
    from tests.url_servers import EXAMPLES, image_http_server
    from wicore.ops.image_fetch import UrlPolicy

    rules = LoadRules(urls=UrlPolicy(allow_hosts=("127.0.0.1",), timeout_s=2.0))
    name = "orange-circle-on-red.png"
    data = (EXAMPLES / name).read_bytes()
    with image_http_server() as base:
        sources = [ImageSource(None, url=f"{base}/{route}") for route in (f"img/{name}", "missing", "hang")]
        pool = PixelPool(1, SPEC, rules)
        try:
            good, missing, hang = [future.result(timeout=60) for future in [pool.submit(s) for s in sources]]
        finally:
            pool.close()
    assert good.sha256 == hashlib.sha256(data).hexdigest() and good.error == ""
    assert np.array_equal(good.pixels, load_pixels(blob(data), LoadRules(), SPEC).pixels)
    assert missing.error == f"ImageFetchError: {base}/missing: HTTP 404 Not Found" and missing.sha256 is None
    assert hang.error == f"ImageFetchError: {base}/hang: the server did not answer within the timeout"


def test_s3_urls_are_fetched_in_the_decode_processes():
    from tests.url_servers import BUCKET, EXAMPLES, s3_server
    from wicore.ops.image_fetch import UrlPolicy

    name = "white-cross-on-red.jpg"
    data = (EXAMPLES / name).read_bytes()
    with s3_server() as endpoint:  # the processes start with its credentials in their environment
        rules = LoadRules(urls=UrlPolicy(s3_endpoint_url=endpoint, timeout_s=10))
        pool = PixelPool(1, SPEC, rules)
        try:
            sources = [ImageSource(None, url=f"s3://{BUCKET}/examples/{key}") for key in (name, "gone.jpg")]
            good, gone = [future.result(timeout=60) for future in [pool.submit(s) for s in sources]]
        finally:
            pool.close()
    assert good.sha256 == hashlib.sha256(data).hexdigest()
    assert np.array_equal(good.pixels, load_pixels(blob(data), LoadRules(), SPEC).pixels)
    assert gone.error == f"ImageFetchError: s3://{BUCKET}/examples/gone.jpg: no such object"
