"""One request's life in the fast engine."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from wicore.engines.base import Completion, EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.kvcache.gpu_tier import CachedBlock, Restore
from wicore.engines.kvcache.prefix_keys import PromptKeys

log = logging.getLogger(__name__)


class SeqStatus(str, Enum):
    WAITING = "waiting"  # tokenized; no KV pages yet
    ENCODING = "encoding"  # admitted (table row + pages); images queued for / in the vision tower
    READY = "ready"  # image embeddings on the device; waits for prefill
    RUNNING = "running"  # prefilled; decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    prompt: Prompt
    pixels: Future | np.ndarray | None  # resized images uint8 [num_images, H, W, 3] (a Future while resized)
    seed: int
    status: SeqStatus = SeqStatus.WAITING
    row: int = -1  # row of the device block tables / last-token buffer while admitted
    pages: list[int] = field(default_factory=list)
    table: np.ndarray | None = None  # [groups, width] int32 page of each logical block
    vision_launched: bool = False
    image_embeds: torch.Tensor | None = None  # [num_images, tokens_per_image, hidden] on the device
    vision_event: torch.cuda.Event | None = None  # recorded on the side stream after the embeddings
    generated: list[int] = field(default_factory=list)  # tokens read back so far
    launched: int = 0  # tokens whose sampling has been launched on the device
    finished: bool = False
    completion: Completion | None = None
    added_at: float = field(default_factory=time.perf_counter)
    # The prefix cache (kvcache/gpu_tier.py, kvcache/tiers.py). Keys are None for a sequence that is not cached.
    prefix_keys: PromptKeys | Future | None = None  # a Future while hashed in a thread
    disk_lookup: bool = False  # admission waits for a disk prefetch (`prefetched`)
    prefetched: dict | Future | None = None  # key -> CPU block [G, slots, 2, bs, H, D] read from disk
    prefix_len: int = 0  # prompt tokens whose K/V come from the cache (not prefilled)
    first_image: int = 0  # images before it lie wholly in the cached prefix (no embeddings needed)
    shared_len: int = 0  # positions in blocks taken from the cache: prefill must not write them
    held: list[CachedBlock] = field(default_factory=list)  # cached blocks in use (released at the end)
    reads: list[CachedBlock] = field(default_factory=list)  # cached blocks prefill waits on (`ready`)
    restores: list[Restore] = field(default_factory=list)  # blocks to bring up from host / disk

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.ids)

    @property
    def max_new(self) -> int:
        return self.request.params.max_new_tokens

    @property
    def max_len(self) -> int:
        """Positions the sequence may ever hold: its KV reservation."""
        return self.prompt_len + self.max_new

    @property
    def num_images(self) -> int:
        return len(self.request.images)

    @property
    def image_keys(self) -> list[str | None]:
        """Each image's sha256 (`EngineRequest.image_hashes`), or all None when the caller gave
        none (or not one per image): such images are never shared or cached."""
        hashes = list(self.request.image_hashes)
        return hashes if len(hashes) == self.num_images else [None] * self.num_images

    @property
    def pixels_ready(self) -> bool:
        if not isinstance(self.pixels, Future):
            return True
        return self.pixels.done() and self.pixels.exception() is None

    @property
    def pixels_failed(self) -> bool:
        return isinstance(self.pixels, Future) and self.pixels.done() and self.pixels.exception() is not None

    def pixel_array(self) -> np.ndarray:
        return self.pixels.result() if isinstance(self.pixels, Future) else self.pixels

    def age(self) -> float:
        return time.perf_counter() - self.added_at

    @property
    def next_position(self) -> int:
        """Position of the token the next decode step feeds (the last one sampled)."""
        return self.prompt_len + self.launched - 1

    @property
    def wants_decode(self) -> bool:
        return self.status == SeqStatus.RUNNING and not self.finished and self.launched < self.max_new

    # -- the prefix cache -------------------------------------------------------------------

    @property
    def keys_ready(self) -> bool:
        return not isinstance(self.prefix_keys, Future) or self.prefix_keys.done()

    def keys(self) -> PromptKeys | None:
        """The prompt's keys (once `keys_ready`); a key job that failed leaves it uncached."""
        if isinstance(self.prefix_keys, Future):
            error = self.prefix_keys.exception()
            if error is not None:
                log.warning("sequence %s: prefix keys failed (%s); not cached", self.id, error)
            self.prefix_keys = None if error is not None else self.prefix_keys.result()
        return self.prefix_keys

    @property
    def prefetch_ready(self) -> bool:
        if not self.disk_lookup:
            return True
        return self.prefetched is not None and (not isinstance(self.prefetched, Future) or self.prefetched.done())

    @property
    def prefix_ready(self) -> bool:
        """Every cached block its prefill reads is written (or queued before it on the stream)."""
        return not self.restores and all(block.ready for block in self.reads)

    @property
    def images_in_suffix(self) -> bool:
        """Some image's soft tokens are prefilled (they need its embeddings)."""
        return self.first_image < self.num_images

    @property
    def needs_vision(self) -> bool:
        """Prefilled images whose embeddings are not known yet (a vision-cache hit arrives with
        them; images in a cached KV prefix need none)."""
        return self.images_in_suffix and self.image_embeds is None
