"""From a claimed job to an engine request: parse its payload, fetch its images (blobs, allowed
paths or URLs; none for a text-only job), check their hashes, decode them; for an engine that
takes its images resized (`Engine.pixel_spec`) and a worker given decode processes, all of that
and the resize run in those processes
(`wicore.ops.pixel_pool`), off this process's GIL. Every failure here is the job's own (an
input error), reported per job, with the same message on either path."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from redis import Redis

from wicore import defaults, keys
from wicore.engines.base import EngineRequest
from wicore.errors import DeadlineExceeded, ImageNotAllowed, InvalidJob, OverLimit, TooManyImages
from wicore.ops.image_decode import ImageLimits
from wicore.ops.image_fetch import UrlPolicy
from wicore.ops.image_load import ImageSource, LoadRules, input_error_message, load_image
from wicore.ops.image_preprocess import PreprocessSpec
from wicore.ops.pixel_pool import PixelPool, PixelResult
from wicore.priority_pool import PriorityPool
from wicore.schemas import CaptionJob, ImageRef, SamplingLimits
from wicore.worker.rq_bridge import Claimed


@dataclass(frozen=True)
class InputConfig:
    allowed_roots: tuple[Path, ...] = ()  # path references must resolve under one of these
    limits: ImageLimits = field(default_factory=ImageLimits)
    # Image decoding runs here. PIL releases the GIL while decoding, but every thread still takes
    # it between calls: more threads than needed slow the engine's own (Python) thread.
    threads: int = min(8, os.cpu_count() or 4)
    # Processes that read, decode and resize images for an engine with a `pixel_spec`; 0: the
    # threads above decode and the engine resizes.
    processes: int = 0
    urls: UrlPolicy = field(default_factory=UrlPolicy)  # which image URLs are fetched, and the bounds
    # The checkpoint's generation_config.json defaults for the parameters a request leaves unset.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_images_per_request: int = defaults.MAX_IMAGES_PER_REQUEST  # a job with more fails alone
    sampling: SamplingLimits = field(default_factory=SamplingLimits)  # a job over max_n / max_logprobs fails alone


@dataclass
class Loaded:
    request: EngineRequest | None = None
    error: str | None = None
    preprocess_s: float = 0.0


class InputLoader:
    def __init__(
        self,
        connection: Redis,
        config: InputConfig,
        pixel_spec: PreprocessSpec | None = None,
        fit: tuple[int, int] | None = None,
    ):
        """`pixel_spec`: the engine's, when it takes images resized; `fit`: the (height, width)
        the engine resizes images to (`Engine.image_size`), near which a far larger image is
        shrunk as it decodes."""
        self.connection = connection
        self.config = config
        self.fit = fit
        self.rules = LoadRules(tuple(root.resolve() for root in config.allowed_roots), config.limits, config.urls)
        self.pool = PriorityPool(config.threads, "wicore-decode")  # a high-lane job's image goes first
        use_processes = config.processes > 0 and pixel_spec is not None
        self.pixels = PixelPool(config.processes, pixel_spec, self.rules) if use_processes else None

    def submit(self, jobs: list[tuple[str, CaptionJob]]) -> list[Future[Loaded]]:
        """One MGET for every blob now; loading runs in the pool, by lane. Order follows `jobs`:
        (request id, job) pairs, each request id becoming its `EngineRequest`'s."""
        shas = list(dict.fromkeys(i.sha256 or "" for _, job in jobs for i in job.images if i.is_blob))
        blobs = dict(zip(shas, self.connection.mget([keys.blob(s) for s in shas]))) if shas else {}
        return [self._submit_one(request_id, job, blobs) for request_id, job in jobs]

    def load(self, jobs: list[tuple[str, CaptionJob]]) -> list[Loaded]:
        """`submit`, waiting for every result."""
        return [future.result() for future in self.submit(jobs)]

    def _submit_one(self, request_id: str, job: CaptionJob, blobs: dict[str, bytes | None]) -> Future[Loaded]:
        if len(job.images) > self.config.max_images_per_request:
            limit = self.config.max_images_per_request
            error = TooManyImages(f"{len(job.images)} images in one job; at most {limit} (max_images_per_request)")
            return _done(Loaded(error=input_error_message(error)))
        try:
            self.config.sampling.check(job.params)
        except OverLimit as error:
            return _done(Loaded(error=input_error_message(error)))
        if not job.images:  # text only: nothing to load
            return _done(_text_only(request_id, job, self.config.generation_defaults))
        if self.pixels is None:
            return self.pool.submit(self._load_one, request_id, job, blobs, rank=job.priority.rank)
        try:
            sources = [_source(image, blobs.get(image.sha256 or "")) for image in job.images]
        except ImageNotAllowed as exc:
            return _done(Loaded(error=input_error_message(exc)))
        then = partial(_resized_all, request_id, job, self.config.generation_defaults)
        if len(sources) == 1:
            return self.pixels.submit(sources[0], lambda result: then([result]))
        return _gathered([self.pixels.submit(source) for source in sources], then)

    def _load_one(self, request_id: str, job: CaptionJob, blobs: dict[str, bytes | None]) -> Loaded:
        start = time.perf_counter()
        try:
            loaded = [load_image(_source(i, blobs.get(i.sha256 or "")), self.rules, self.fit) for i in job.images]
            params = job.params.with_defaults(self.config.generation_defaults)
        except Exception as exc:  # whatever an input does to the loaders is that job's alone
            return Loaded(error=input_error_message(exc), preprocess_s=time.perf_counter() - start)
        images, hashes = [image for image, _ in loaded], [sha256 for _, sha256 in loaded]
        request = EngineRequest(request_id, job.chat(), list(images), params, hashes, job.priority)
        return Loaded(request=request, preprocess_s=time.perf_counter() - start)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.pixels is not None:
            self.pixels.close()


def _source(image: ImageRef, blob: bytes | None) -> ImageSource:
    """Where an image's bytes are: the blob fetched from Redis, a path, or a URL."""
    if image.url is not None:
        return ImageSource(None, url=image.url)
    if image.path is not None:
        return ImageSource(image.sha256, path=image.path)
    if blob is None:
        raise ImageNotAllowed(f"image blob {(image.sha256 or '')[:12]} is not in Redis (expired?)")
    return ImageSource(image.sha256, data=blob)


def _text_only(request_id: str, job: CaptionJob, defaults: dict[str, Any]) -> Loaded:
    try:
        params = job.params.with_defaults(defaults)
    except ValueError as exc:  # pydantic's errors are ValueErrors
        return Loaded(error=input_error_message(exc))
    return Loaded(request=EngineRequest(request_id, job.chat(), [], params, [], job.priority))


def _resized_all(request_id: str, job: CaptionJob, defaults: dict[str, Any], results: list[PixelResult]) -> Loaded:
    """The decode processes' results (one per image, in order) as the job's: its request carries
    the resized uint8 images; its first failing image fails it; seconds add up."""
    seconds = sum(result.seconds for result in results)
    images, hashes = [], []
    for result in results:
        if result.pixels is None or result.sha256 is None:
            return Loaded(error=result.error, preprocess_s=seconds)
        images.append(result.pixels)
        hashes.append(result.sha256)
    try:
        params = job.params.with_defaults(defaults)
    except ValueError as exc:  # pydantic's errors are ValueErrors
        return Loaded(error=input_error_message(exc), preprocess_s=seconds)
    request = EngineRequest(request_id, job.chat(), list(images), params, hashes, job.priority)
    return Loaded(request, preprocess_s=seconds)


def _gathered(futures: list[Future], then) -> Future[Loaded]:
    """A future of `then([each future's result])`, set when the last of them lands."""
    out: Future[Loaded] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def landed(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(then([f.result() for f in futures]))
        except Exception as error:  # a canceled or failed decode: the caller reads it from `out`
            out.set_exception(error)

    for future in futures:
        future.add_done_callback(landed)
    return out


def _done(loaded: Loaded) -> Future[Loaded]:
    future: Future[Loaded] = Future()
    future.set_result(loaded)
    return future


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
