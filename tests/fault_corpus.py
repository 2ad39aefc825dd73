"""A corpus of malformed inputs for wicore workers, with how each one must end.

    python -m tests.fault_corpus --redis-url redis://127.0.0.1:6379/0 --root /tmp/corpus

writes it into that Redis (files for path references under ROOT; a worker serves it with
`--model-id corpus --allow-root ROOT/allowed`) and prints the count per kind.
tests/test_faults_corpus.py runs it against a real worker process.

Kinds: images (garbage, truncated, odd formats, decompression bombs, hash mismatches, missing
blobs), prompts (lone surrogates, NUL bytes, control characters, image-token text, huge),
parameters (out of range, through the producer and planted past it), raw job hashes (every
malformed field a hand-written client could leave) and paths (escapes of the allowed root, NUL
bytes, surrogates, links, devices). Good jobs are mixed in between the kinds.

An end is "result", "refused" (the producer raised a clear error at submit), "dead-letter" (an
entry in `wicore:dead-letter` with its reason), or the name of the error class a failed job's
message starts with.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from tests.helpers import payload_data, plant_job, png_bytes
from wicore import keys
from wicore.producer import Producer, ProducerConfig
from wicore.scheduler.buckets import ShapeRules
from wicore.schemas import CaptionJob, GenerationParams, ImageRef

MODEL = "corpus"
TASK = "wicore.worker.tasks.caption"
PARAMS = GenerationParams(max_new_tokens=2)
RESULT, REFUSED, DEAD = "result", "refused", "dead-letter"
NOT_ALLOWED = "ImageNotAllowed"
IMAGE_ERRORS = frozenset({"ImageError", "ImageTooLarge", NOT_ALLOWED})


@dataclass
class Planted:
    kind: str
    expect: frozenset[str]  # the ends this input may have
    job_id: str | None = None  # None: refused at submit
    refusal: str = ""


@dataclass
class Corpus:
    connection: Redis
    root: Path
    seed: int = 0
    planted: list[Planted] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.producer = Producer(self.connection, model=MODEL, config=ProducerConfig(retries=2))
        self.allowed = self.root / "allowed"
        self.allowed.mkdir(parents=True, exist_ok=True)
        self.good_image = png_bytes(1, (48, 40))
        self.template = self.producer.submit(self.good_image, "template", params=PARAMS)
        self.planted.append(Planted("good", frozenset({RESULT}), self.template))
        self.queue = ShapeRules().bucket(self._job(self.good_image)).queue_name
        self._n = 0

    # -- ways in ------------------------------------------------------------------------------

    def submit(self, kind: str, expect: set[str], image, prompt="describe", **fields) -> None:
        """Through the producer, as a service would."""
        fields.setdefault("params", PARAMS)
        try:
            job_id = self.producer.submit(image, prompt, **fields)
        except Exception as exc:  # what the caller sees
            self.planted.append(Planted(kind, frozenset(expect), refusal=f"{type(exc).__name__}: {exc}"[:200]))
            return
        self.planted.append(Planted(kind, frozenset(expect), job_id))

    def payload(self, kind: str, expect: set[str], payload: dict) -> None:
        """Past the producer's checks: an RQ job whose payload is `payload` as given."""
        job_id = self._id(kind)
        data = Queue.prepare_data(TASK, args=[payload], job_id=job_id, result_ttl=86_400, failure_ttl=86_400)
        Queue(self.queue, connection=self.connection, serializer=JSONSerializer).enqueue_many([data])
        self.planted.append(Planted(kind, frozenset(expect), job_id))

    def raw(self, kind: str, expect: set[str], job_id: str | None = None, **fields) -> None:
        """A hand-written job hash: the template job's fields (as queued) with `fields` on top."""
        job_id = job_id or self._id(kind)
        fields = {"status": "queued", "ended_at": None, "started_at": None, "worker_name": None, **fields}
        plant_job(self.connection, self.queue, job_id, self.template, **fields)
        self.planted.append(Planted(kind, frozenset(expect), job_id))

    def good(self, count: int = 10) -> None:
        for _ in range(count):
            self.submit("good", {RESULT}, self.good_image, f"good job {self._next()}")

    def _id(self, kind: str) -> str:
        return f"corpus-{kind}-{self._next()}"

    def _next(self) -> int:
        self._n += 1
        return self._n

    def _job(self, image: bytes, **fields) -> CaptionJob:
        import hashlib

        ref = ImageRef(sha256=hashlib.sha256(image).hexdigest())
        return CaptionJob(image=ref, prompt="describe", model=MODEL, params=PARAMS, **fields)

    def base_payload(self) -> dict:
        return self._job(self.good_image).model_dump(mode="json")

    # -- the corpus ---------------------------------------------------------------------------

    def build(self) -> list[Planted]:
        for plant in (self.images, self.prompts, self.parameters, self.raw_hashes, self.paths):
            plant()
            self.good()
        return self.planted

    def images(self) -> None:
        either = IMAGE_ERRORS | {RESULT}
        for _ in range(220):
            garbage = self.rng.randbytes(self.rng.randint(1, 4000))
            self.submit("image-garbage", IMAGE_ERRORS, garbage, f"garbage {self._next()}")
        for fmt in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"):
            whole = encoded(self.rng, fmt)
            for _ in range(20):
                cut = whole[: self.rng.randint(1, len(whole) - 1)]
                self.submit("image-truncated", either, cut, f"truncated {self._next()}")
        for i, image in enumerate(odd_images(self.rng)):
            self.submit("image-odd-format", {RESULT}, image, f"odd format {i}")
        for width, height in [(60_000, 60_000), (100_000, 1_000), (1_000, 2**31 - 1), (8_000, 8_000)] * 5:
            self.submit("image-bomb", {"ImageTooLarge"}, png_header_only(width, height), f"bomb {self._next()}")
        self.submit("image-empty", {REFUSED, "ImageError"}, b"", "empty")
        for i in range(20):
            other = png_bytes(500 + i)
            self.connection.set(keys.blob(self._job(other).images[0].sha256), png_bytes(900 + i), ex=3600)
            self.payload("image-hash-mismatch", {"ImageError"}, self._job(other).model_dump(mode="json"))
        for i in range(20):
            self.payload(
                "image-missing-blob", {"ImageNotAllowed"}, self._job(png_bytes(700 + i)).model_dump(mode="json")
            )

    def prompts(self) -> None:
        texts = {
            "prompt-nul": ["a\x00b", "\x00" * 50, "end with nul\x00"],
            "prompt-control": ["\x01\x02\x1b[31mred\x1b[0m", "tab\tand\rcarriage", "\u202eevil rtl", "zero\u200bwidth"],
            "prompt-unicode": ["émoji 🙂🙃", "中文描述", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "", "   ", "a" * 3000],
        }
        for kind, samples in texts.items():
            for text in samples * 6:
                self.submit(kind, {RESULT, "PromptTooLong"}, self.good_image, text + f" #{self._next()}")
        for text in ["<start_of_image>", "look <start_of_image> here", "<image_soft_token>", "x<image_soft_token>"] * 6:
            self.submit("prompt-image-token", {"JobInputError"}, self.good_image, f"{text} #{self._next()}")
        for _ in range(10):
            self.submit("prompt-huge", {"PromptTooLong"}, self.good_image, "word " * 40_000 + str(self._next()))
        for lone in ["\ud800", "a\udfffb", "\udc80" * 3]:
            for _ in range(8):
                self.submit("prompt-surrogate", {REFUSED}, self.good_image, lone + str(self._next()))
                self.payload("prompt-surrogate", {"InvalidJob"}, {**self.base_payload(), "prompt": lone})
        for parts in ([], [{"type": "text", "text": "no image"}], [{"type": "image"}, {"type": "image"}]):
            messages = [{"role": "user", "content": parts}]
            for _ in range(5):
                self.payload(
                    "prompt-messages", {"InvalidJob"}, {**self.base_payload(), "prompt": None, "messages": messages}
                )

    def parameters(self) -> None:
        bad = [
            {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 10**9}, {"max_new_tokens": "many"},
            {"temperature": -1.0}, {"temperature": float("inf")}, {"temperature": float("nan")},
            {"top_p": 0.0}, {"top_p": 2.0}, {"top_k": -5}, {"seed": -1}, {"seed": 2**64}, {"stop": [""]},
            {"unknown": 1}, {"stop": "not a list"},
        ]  # fmt: skip
        for fields in bad * 4:
            try:
                params = GenerationParams(**fields)
            except Exception as exc:
                refusal = f"{type(exc).__name__}: {exc}"[:200]
                self.planted.append(Planted("params-refused", frozenset({REFUSED}), refusal=refusal))
            else:
                self.submit("params-refused", {REFUSED}, self.good_image, params=params)
            payload = {**self.base_payload(), "params": {**PARAMS.model_dump(mode="json"), **fields}}
            self.payload("params-planted", {"InvalidJob"}, json.loads(json.dumps(payload)))
        edge = [{"max_new_tokens": 1}, {"temperature": 100.0, "seed": 2**63 - 1}, {"top_k": 1}, {"stop": ["a"] * 40}]
        for fields in edge * 5:
            params = GenerationParams(**{"max_new_tokens": 2, **fields})
            self.submit("params-edge", {RESULT}, self.good_image, f"edge {self._next()}", params=params)

    def raw_hashes(self) -> None:
        invalid = {
            "not-json": {"data": b"{oops"},
            "json-object": {"data": zlib.compress(json.dumps({"a": 1}).encode())},
            "short-list": {"data": json.dumps([TASK, None])},
            "bad-utf8": {"data": b"\xff\xfe[1, 2]"},
            "deep-nesting": {"data": "[" * 200_000 + "]" * 200_000},
            "zlib-pickle": {"data": zlib.compress(pickle.dumps((TASK, None, [{}], {})))},
            "raw-pickle": {"data": pickle.dumps((TASK, None, [{}], {}))},
            "zlib-bomb": {"data": zlib.compress(b"[" + b" " * (20 * 2**20) + b"]")},
            "other-function": {"data": json.dumps(["os.system", None, ["true"], {}])},
            "args-not-list": {"data": json.dumps([TASK, None, {"a": 1}, {}])},
            "args-two": {"data": json.dumps([TASK, None, [{}, {}], {}])},
            "payload-not-dict": {"data": payload_data([1, 2, 3])},
            "pickle-meta": {"meta": pickle.dumps({"notify": "x"})},
            "list-meta": {"meta": "[1, 2]"},
            "no-data": {"data": None},
        }
        runnable = {
            "no-origin": {"origin": None},
            "bad-numbers": {"retries_left": "many", "result_ttl": "soon", "timeout": "nan", "failure_ttl": "-x"},
            "huge-numbers": {"retries_left": "1e999", "result_ttl": "99999999999999999999", "timeout": "-7"},
            "bad-enqueued-at": {"enqueued_at": "yesterday"},
            "bad-status": {"status": "weird"},
            "notify-elsewhere": {"meta": json.dumps({"notify": "rq:queue:" + self.queue})},
        }
        for _ in range(8):
            for name, fields in invalid.items():
                self.raw(f"raw-{name}", {"InvalidJob"}, **fields)
            for name, fields in runnable.items():
                payload = {**self.base_payload(), "prompt": f"{name} {self._next()}"}
                self.raw(f"raw-{name}", {RESULT}, data=payload_data(payload), **fields)
            no_hash = plant_job(self.connection, self.queue, self._id("raw-no-hash"), "no-such-job")  # an id alone
            self.planted.append(Planted("raw-no-hash", frozenset({DEAD}), no_hash))
            for bad_id in (f"bad id {self._next()}", f"nul\x00{self._next()}", f"slash/{self._next()}"):
                self.connection.rpush(f"rq:queue:{self.queue}", bad_id)
                self.planted.append(Planted("raw-bad-id", frozenset({DEAD}), bad_id))
            self.connection.rpush(f"rq:queue:{self.queue}", b"\xff\xfe" + str(self._next()).encode())
            self.planted.append(Planted("raw-bad-id", frozenset({DEAD}), "<non-utf8>"))

    def paths(self) -> None:
        image = png_bytes(3, (32, 32))
        inside = self.allowed / "good.png"
        inside.write_bytes(image)
        outside = self.root / "outside.png"
        outside.write_bytes(image)
        links = self.allowed / "links"
        links.mkdir(exist_ok=True)
        for name, target in [("out", outside), ("loop", links / "loop"), ("dev", Path("/dev/zero"))]:
            if not (links / name).is_symlink():
                (links / name).symlink_to(target)
        fifo = self.allowed / "fifo.png"
        if not fifo.exists():
            os.mkfifo(fifo)
        cases = {
            "path-escape": ([str(self.allowed / ".." / "outside.png"), str(outside), "/etc/passwd", "/proc/self/environ",
                             str(links / "out"), "outside.png", "//etc//passwd", "~/.bashrc"], {NOT_ALLOWED}),
            "path-inside-bad": ([str(self.allowed), str(fifo), str(self.allowed / "missing.png"), str(links / "dev"),
                                 str(links / "loop"), str(self.allowed / "%2e%2e" / "outside.png")],
                                IMAGE_ERRORS),
            "path-nul": ([str(inside) + "\x00.txt", "\x00", str(self.allowed) + "/\x00/../good.png"], {"InvalidJob"}),
            "path-surrogate": ([str(self.allowed / "bad\udc80.png"), "\ud800"], {"InvalidJob"}),
            "path-too-long": (["/" + "a" * 5000, ""], {"InvalidJob"}),
            "path-good": ([str(inside), str(self.allowed / "links" / ".." / "good.png")], {RESULT}),
        }  # fmt: skip
        sha = self._job(image).images[0].sha256
        for _ in range(6):
            for kind, (paths, expect) in cases.items():
                for path in paths:
                    payload = {**self.base_payload(), "images": [{"sha256": sha, "path": path}]}
                    self.payload(kind, set(expect), payload)
        by_path = Producer(self.connection, model=MODEL, config=ProducerConfig(by_path=True))
        for _ in range(6):
            try:
                by_path.submit(str(self.allowed / f"missing{self._next()}.png"), params=PARAMS)
            except Exception as exc:
                self.planted.append(
                    Planted("path-producer", frozenset({REFUSED}), refusal=f"{type(exc).__name__}: {exc}")
                )


# -- image material ---------------------------------------------------------------------------


def encoded(rng: random.Random, fmt: str, size=(64, 48), mode="RGB") -> bytes:
    pixels = np.random.default_rng(rng.randint(0, 2**31)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def odd_images(rng: random.Random) -> list[bytes]:
    """Valid images a decoder may not expect: every mode and format Pillow writes, odd sizes,
    an animation, EXIF rotation."""
    images = []
    for fmt, modes in [("PNG", ["1", "L", "LA", "P", "RGBA", "I;16"]), ("JPEG", ["L", "CMYK"]),
                       ("GIF", ["P", "L"]), ("WEBP", ["RGBA"]), ("TIFF", ["CMYK", "F"]), ("BMP", ["1", "P"])]:  # fmt: skip
        images += [encoded(rng, fmt, (rng.randint(1, 80), rng.randint(1, 80)), mode) for mode in modes]
    images += [encoded(rng, "PNG", size) for size in [(1, 1), (1, 2000), (2000, 1), (3, 3)]]
    frames = [Image.new("RGB", (20, 20), color) for color in ("red", "green", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    images.append(buffer.getvalue())
    rotated = Image.new("RGB", (30, 10), "white")
    exif = rotated.getexif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    rotated.save(buffer, format="JPEG", exif=exif)
    images.append(buffer.getvalue())
    return images * 2


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` and whose data is a few bytes: a
    decompression bomb's calling card."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def counts(planted: list[Planted]) -> Counter:
    return Counter(p.kind for p in planted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    planted = Corpus(Redis.from_url(args.redis_url), args.root).build()
    for kind, n in sorted(counts(planted).items()):
        print(f"{kind:24} {n}")
    print(f"{'total':24} {len(planted)}")


if __name__ == "__main__":
    main()
