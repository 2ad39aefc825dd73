"""From a request's images to their embeddings, doing each image's work once.

- At `add`: one cache lookup for every image of the call (local LRU, then the shared store the
  worker attached, e.g. Redis); a sequence whose images are all cached skips pixels and the
  vision tower. Others get their images resized in the pool (uint8; the model runner applies
  the pixel lookup table on the device), one job per distinct image, unless they came resized
  (the worker's decode processes, `FastEngine.pixel_spec`).
- At launch: a sequence whose images are already being encoded (another question about the
  same image) attaches to that vision batch; repeated images inside a batch are encoded once.
  An urgent batch (a leading lane's, `StepPlanner`) runs on the main stream, beside the batches
  queued on the side stream, and is collected whenever it is done.
- At completion: the new embeddings go into the cache.

Images are known by the sha256 of their bytes (`EngineRequest.image_hashes`); without hashes
nothing is shared or cached.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from wicore.engines.fast.device_handles import VisionJob, poll
from wicore.engines.fast.prompt_inputs import InputProcessor
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.pending import Pending
from wicore.engines.vision_cache import EmbeddingStore, LocalVisionCache, VisionCache
from wicore.errors import JobInputError
from wicore.ops.image_preprocess import is_resized
from wicore.priority_pool import PriorityPool

WAIT_POLL_S = 0.0005  # how often an idle step's `wait` for a vision batch polls


class ImageStage:
    def __init__(self, runner, inputs: InputProcessor, pool: PriorityPool | None, cache_bytes: int):
        self.runner, self.inputs, self.pool = runner, inputs, pool
        self.cache = VisionCache(LocalVisionCache(cache_bytes), device=str(runner.device)) if cache_bytes else None
        self.jobs: deque[VisionJob] = deque()
        self.pending_pixels: dict[str, Pending] = {}  # image hash -> its resize, while unencoded
        self.in_flight: dict[str, tuple[VisionJob, int]] = {}  # image hash -> (job, row of its output)
        self.encoded = 0  # images through the tower (the rest came from the cache or a batch mate)

    def attach_shared(self, store: EmbeddingStore | None) -> None:
        if self.cache is not None:
            self.cache.shared = store

    # -- at add ----------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> list[tuple[Sequence, JobInputError]]:
        """Cached embeddings, or pixel work (shared by repeated images), for each sequence.
        Returns the sequences whose images could not be preprocessed (inline, on CPU)."""
        keys = [k for s in seqs for k in s.image_keys if k is not None]
        cached = self.cache.get_many(keys) if self.cache is not None and keys else {}
        failures = []
        for seq in seqs:
            seq_keys = seq.image_keys
            if seq.num_images and all(k in cached for k in seq_keys):
                seq.vision.embeds = torch.stack([cached[k] for k in seq_keys])  # [n, tokens, hidden]
                seq.vision.pixels = Pending.now(self.inputs.resized([]))  # uint8 [0, H, W, 3]: nothing to encode
                continue
            try:
                seq.vision.pixels = self._pixels(seq, seq_keys)
            except JobInputError as error:
                failures.append((seq, error))
        return failures

    def _pixels(self, seq: Sequence, keys: list[str | None]) -> Pending[np.ndarray]:
        """The sequence's resized images, uint8 [num_images, H, W, 3] (made in the pool)."""
        if not seq.num_images:
            return Pending.now(self.inputs.resized([]))
        if self.pool is None or is_resized(seq.request.images):  # resized by the caller: nothing to do
            try:
                return Pending.now(self.inputs.resized(seq.request.images))
            except Exception as error:
                raise JobInputError(f"image preprocessing failed: {error}") from error
        key = keys[0] if len(keys) == 1 else None
        if key is not None and key in self.pending_pixels:
            return self.pending_pixels[key]
        pixels = Pending(self.pool.submit(self.inputs.resized, seq.request.images, rank=seq.rank))
        if key is not None:
            self.pending_pixels[key] = pixels
        return pixels

    # -- launch and completion ----------------------------------------------------------------

    def launch(self, seqs: list[Sequence], urgent: bool = False) -> int:
        """Encode what is new (`urgent`: on the main stream); attach what is on its way; take
        what was cached since `add`. Returns the number of images encoded."""
        fresh = []
        for seq in seqs:
            keys = seq.image_keys
            if keys and all(k is not None and k in self.in_flight for k in keys):
                for k in keys:
                    job, row = self.in_flight[k]
                    job.attached.append((seq, [row]))
            elif self._cached_since_add(seq, keys):
                seq.move(SeqStatus.PREFILL)
            else:
                fresh.append(seq)
        if not fresh:
            return 0
        job = self._encode(fresh, urgent)
        self.jobs.append(job)
        return len(job.keys)

    def _cached_since_add(self, seq: Sequence, keys: list[str | None]) -> bool:
        local = self.cache.local if self.cache is not None else None
        if local is None or not keys or not all(k is not None and k in local for k in keys):
            return False
        seq.vision.embeds = torch.stack([local.get(k) for k in keys])
        return True

    def _encode(self, seqs: list[Sequence], urgent: bool) -> VisionJob:
        rows: dict[str, int] = {}
        arrays, keys, members = [], [], []
        for seq in seqs:
            pixels, indices = seq.vision.pixels.value, []
            for i, key in enumerate(seq.image_keys):
                if key is None or key not in rows:
                    if key is not None:
                        rows[key] = len(arrays)
                    indices.append(len(arrays))
                    arrays.append(pixels[i])
                    keys.append(key)
                else:
                    indices.append(rows[key])
            members.append((seq, indices))
        embeds, event = self.runner.encode_images(arrays, urgent)
        job = VisionJob([], event, embeds=embeds, keys=keys)
        for seq, indices in members:
            seq.vision.embeds = self.runner.take(embeds, indices, urgent)
            seq.vision.event = event
            job.seqs.append(seq)
        for key in rows:
            self.in_flight[key] = (job, rows[key])
            self.pending_pixels.pop(key, None)
        self.encoded += len(arrays)
        return job

    def collect(self) -> None:
        """Finished vision batches: their sequences become ready, attached ones get their rows,
        and the new embeddings go into the cache (as copies, so a cached image does not keep
        its whole batch's output alive). An urgent batch may be done before older ones."""
        for job in [job for job in self.jobs if job.done()]:
            self.jobs.remove(job)
            for seq in job.seqs:
                seq.move(SeqStatus.PREFILL)
            for seq, indices in job.attached:
                seq.vision.embeds = job.embeds[indices]
                seq.move(SeqStatus.PREFILL)
            fresh = {k: job.embeds[row].clone() for row, k in enumerate(job.keys) if k is not None}
            for key in fresh:
                self.in_flight.pop(key, None)
            if self.cache is not None and fresh:
                self.cache.put_many(fresh)

    @property
    def num_queued(self) -> int:
        """Vision batches launched and not collected yet."""
        return len(self.jobs)

    def any_done(self) -> bool:
        """Some vision batch on the device is done (collecting it frees a slot for the next)."""
        return any(job.done() for job in self.jobs)

    def wait(self, timeout: float) -> None:
        """Until a vision batch is done, or `timeout` seconds."""
        deadline = time.perf_counter() + timeout
        poll(lambda: not self.jobs or self.any_done(), lambda: time.perf_counter() >= deadline, WAIT_POLL_S)

    def drop(self, seq: Sequence) -> None:
        """A sequence that stops: it leaves the vision batches it waits on (they still run and
        cache their embeddings for others) and lets go of its embeddings."""
        for job in self.jobs:
            job.seqs = [s for s in job.seqs if s is not seq]
            job.attached = [(s, rows) for s, rows in job.attached if s is not seq]
        seq.vision.embeds, seq.vision.event = None, None

    def close(self) -> None:
        """Write the embeddings still queued for the shared store."""
        if self.cache is not None:
            self.cache.close()

    def reset(self) -> None:
        """Forget the vision batches in flight (after a failed step)."""
        self.jobs.clear()
        self.in_flight.clear()

    def stats(self) -> dict:
        out = {"images_encoded": self.encoded}
        if self.cache is not None:
            out["vision_cache"] = self.cache.local.stats.to_dict()
            shared = getattr(self.cache.shared, "stats", None)
            if shared is not None:
                out["vision_cache_shared"] = {**shared.to_dict(), "dropped_writes": self.cache.dropped_writes}
        return out
