"""From a claimed job to an engine request: parse its payload, fetch the image (blob or allowed
path), check its hash, decode it. Every failure here is the job's own (an input error), reported
per job."""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from wicore import keys
from wicore.engines.base import EngineRequest
from wicore.errors import DeadlineExceeded, ImageError, ImageNotAllowed, InvalidJob, JobInputError
from wicore.ops.image_decode import ImageLimits, decode_image, read_image_file
from wicore.priority_pool import PriorityPool
from wicore.schemas import CaptionJob
from wicore.worker.rq_bridge import Claimed


@dataclass(frozen=True)
class InputConfig:
    allowed_roots: tuple[Path, ...] = ()  # path references must resolve under one of these
    limits: ImageLimits = field(default_factory=ImageLimits)
    # Image decoding runs here. PIL releases the GIL while decoding, but every thread still takes
    # it between calls: more threads than needed slow the engine's own (Python) thread.
    threads: int = min(8, os.cpu_count() or 4)


@dataclass
class Loaded:
    request: EngineRequest | None = None
    error: str | None = None
    preprocess_s: float = 0.0


class InputLoader:
    def __init__(self, connection: Redis, config: InputConfig):
        self.connection = connection
        self.config = config
        self.roots = tuple(root.resolve() for root in config.allowed_roots)
        self.pool = PriorityPool(config.threads, "wicore-decode")  # a high-lane job's image goes first

    def submit(self, jobs: list[tuple[str, CaptionJob]]) -> list[Future[Loaded]]:
        """One MGET for every blob now; decoding runs in the pool, by lane. Order follows `jobs`."""
        blob_shas = [job.image.sha256 for _, job in jobs if job.image.is_blob]
        blobs = dict(zip(blob_shas, self.connection.mget([keys.blob(s) for s in blob_shas]))) if blob_shas else {}
        return [
            self.pool.submit(self._load_one, job_id, job, blobs.get(job.image.sha256), rank=job.priority.rank)
            for job_id, job in jobs
        ]

    def load(self, jobs: list[tuple[str, CaptionJob]]) -> list[Loaded]:
        """`submit`, waiting for every result."""
        return [future.result() for future in self.submit(jobs)]

    def _load_one(self, job_id: str, job: CaptionJob, blob: bytes | None) -> Loaded:
        start = time.perf_counter()
        try:
            data = blob if job.image.is_blob else self._read_path(job.image.path or "")
            if data is None:
                raise ImageNotAllowed(f"image blob {job.image.sha256[:12]} is not in Redis (expired?)")
            if hashlib.sha256(data).hexdigest() != job.image.sha256:
                raise ImageError("image bytes do not match the sha256 they were submitted with (file changed?)")
            image = decode_image(data, self.config.limits)
        except JobInputError as exc:
            return Loaded(error=f"{type(exc).__name__}: {exc}", preprocess_s=time.perf_counter() - start)
        except Exception as exc:  # whatever else an input does to the loaders is still that job's alone
            error = f"{ImageError.__name__}: cannot load the image ({type(exc).__name__}: {exc})"
            return Loaded(error=error, preprocess_s=time.perf_counter() - start)
        request = EngineRequest(job_id, job.chat(), [image], job.params, [job.image.sha256], job.priority)
        return Loaded(request=request, preprocess_s=time.perf_counter() - start)

    def _read_path(self, raw: str) -> bytes:
        try:
            path = Path(raw).resolve()
        except (ValueError, OSError, RuntimeError) as exc:  # a NUL byte, an unencodable name, a symlink loop
            raise ImageNotAllowed(f"{raw!r} is not a usable path ({exc})") from None
        if not any(path.is_relative_to(root) for root in self.roots):
            raise ImageNotAllowed(f"{raw} is outside the worker's allowed roots (--allow-root)")
        return read_image_file(path, self.config.limits)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def parse_payloads(claimed: list[Claimed]) -> tuple[list[tuple[Claimed, CaptionJob]], list[tuple[Claimed, str]]]:
    """(valid, invalid-with-reason): a record or payload that does not parse fails its job alone."""
    valid, invalid = [], []
    for c in claimed:
        if c.invalid is not None:
            invalid.append((c, c.invalid))
            continue
        try:
            valid.append((c, CaptionJob.model_validate(c.args[0])))
        except (ValueError, TypeError, IndexError, RecursionError) as exc:  # pydantic's errors are ValueErrors
            first_line = str(exc).splitlines()[0][:300]
            invalid.append((c, f"{InvalidJob.__name__}: payload is not a wicore caption job ({first_line})"))
    return valid, invalid


def deadline_message(payload: CaptionJob) -> str:
    late = time.time() - (payload.deadline or 0.0)
    return f"{DeadlineExceeded.__name__}: deadline passed {late:.3f}s before a worker could start it; not run"
