"""One request's life in the fast engine.

`Sequence.status` is the one record of where a request is, and `Sequence.move` is the one place
that changes it: a move that `TRANSITIONS` does not list raises `IllegalTransition`.

    add
     |
     v
  WAITING ---admitted; a prefilled image lacks embeddings---> VISION
     |                                                          |
     | admitted; text only, embeddings cached, or every image   | vision batch done, or
     | inside the cached KV prefix                              | embeddings cached since add
     v                                                          |
  PREFILL <-----------------------------------------------------+
     |
     | prefill launched
     v
  DECODE ---last token read back (length, EOS, stop string)---> FINISHED

  WAITING, VISION, PREFILL, DECODE ---Engine.abort---> ABORTED
  WAITING, VISION, PREFILL, DECODE ---unreadable image, failed step---> FAILED

WAITING: tokenized, queued by lane then arrival, no KV pages; its inputs may still be on their
way (pixels resized and prefix keys hashed in threads, cached blocks read from disk). Admission
takes the head once they are in (`admissible`) and a table row and every page it can ever need
are free. VISION: admitted; its images wait for, or are in, a vision batch. PREFILL: its
embeddings are on the device (or it needs none); its prefill waits for the token budget and for
the cached blocks it reads (`CacheState.blocks_ready`). DECODE: one token per step. FINISHED,
ABORTED and FAILED are final: row and pages are given back. While a better lane has admitted
sequences, a sequence of a worse lane stays where it is (`StepPlanner.lead_rank`).

An abort stops a sequence between steps, except one whose cached blocks other sequences wait
to read (it writes them, or restores them into its pages): that one is stopped once its prefill
is launched (`abort_requested`).

The fields are grouped by their owner: `kv` (the step planner's reservation), `vision` (the
image stage's work), `cache` (the prefix cache's record), `tokens` (the decode's progress).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import numpy as np
import torch

from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.guided import GrammarState
from wicore.engines.kvcache.gpu_tier import CachedBlock, Restore
from wicore.engines.kvcache.prefix_keys import PromptKeys
from wicore.engines.pending import Pending

log = logging.getLogger(__name__)


class SeqStatus(str, Enum):
    WAITING = "waiting"  # tokenized, queued for admission; no KV pages
    VISION = "vision"  # admitted (table row + pages); images wait for / are in the vision tower
    PREFILL = "prefill"  # embeddings on the device (or none needed); waits for its prefill
    DECODE = "decode"  # prefill launched; decoding
    FINISHED = "finished"  # ended by length, EOS or a stop string
    ABORTED = "aborted"  # stopped by `Engine.abort`
    FAILED = "failed"  # its images could not be preprocessed, or a step failed under it


FINAL = frozenset({SeqStatus.FINISHED, SeqStatus.ABORTED, SeqStatus.FAILED})
_STOPS = {SeqStatus.ABORTED, SeqStatus.FAILED}
TRANSITIONS: dict[SeqStatus, frozenset[SeqStatus]] = {
    SeqStatus.WAITING: frozenset({SeqStatus.VISION, SeqStatus.PREFILL, *_STOPS}),
    SeqStatus.VISION: frozenset({SeqStatus.PREFILL, *_STOPS}),
    SeqStatus.PREFILL: frozenset({SeqStatus.DECODE, *_STOPS}),
    SeqStatus.DECODE: frozenset({SeqStatus.FINISHED, *_STOPS}),
    **{status: frozenset() for status in FINAL},
}


class IllegalTransition(RuntimeError):
    """A status change the lifecycle does not allow: a bug in the engine, never bad input."""


@dataclass
class KVSlot:
    """What admission reserved (`StepPlanner`): a table row and every page the sequence can ever
    need."""

    row: int = -1  # row of the device block tables / last-token buffer while admitted
    pages: list[int] = field(default_factory=list)
    table: np.ndarray | None = None  # [groups, width] int32 page of each logical block


@dataclass
class VisionWork:
    """The image stage's work (`ImageStage`): pixels, then embeddings."""

    pixels: Pending[np.ndarray] = field(default_factory=lambda: Pending.now(None))  # uint8 [n, H, W, 3]
    embeds: torch.Tensor | None = None  # [num_images, tokens_per_image, hidden] on the device
    event: torch.cuda.Event | None = None  # recorded on the side stream after the embeddings
    launched: bool = False  # picked for a vision batch (`StepPlanner.schedule_vision`)


@dataclass
class CacheState:
    """The prefix KV cache's record of the sequence (`prefix_admission`, `KVTiers`)."""

    keys: Pending[PromptKeys] | None = None  # None: the sequence is not cached
    disk_lookup: bool = False  # admission waits for a disk read (`prefetched`)
    prefetched: Pending[dict] | None = None  # key -> CPU block [G, slots, 2, bs, H, D] read from disk
    prefix_len: int = 0  # prompt tokens whose K/V come from the cache (not prefilled)
    first_image: int = 0  # images before it lie wholly in the cached prefix (no embeddings needed)
    shared_len: int = 0  # positions in blocks taken from the cache: prefill must not write them
    reads: list[CachedBlock] = field(default_factory=list)  # hits it reads; its prefill waits on `ready`
    writes: list[CachedBlock] = field(default_factory=list)  # registered by it: prefilled or restored
    restores: list[Restore] = field(default_factory=list)  # blocks to bring up from host / disk

    @property
    def held(self) -> list[CachedBlock]:
        """Every cached block it uses (one use each, released when it ends)."""
        return self.reads + self.writes

    @property
    def inputs_ready(self) -> bool:
        """Its keys are hashed and its disk reads done (what admission waits for)."""
        keys_ready = self.keys is None or self.keys.ready
        return keys_ready and (not self.disk_lookup or (self.prefetched is not None and self.prefetched.ready))

    @property
    def blocks_ready(self) -> bool:
        """Every cached block its prefill reads is written (or queued before it on the stream)."""
        return not self.restores and all(block.ready for block in self.reads)

    @property
    def others_wait(self) -> bool:
        """Other sequences read blocks it has still to write, or restores are on their way into its
        pages: it cannot stop before its prefill."""
        return bool(self.restores) or any(b.users > 1 and not b.ready for b in self.writes)

    def unwritten(self) -> list[CachedBlock]:
        """Blocks it registered, never wrote, and no one else uses: they leave the cache with it."""
        return [b for b in self.writes if not b.ready and b.users == 1]


@dataclass
class TokenState:
    """The decode's progress (the engine reads tokens back, the model runner launches them)."""

    generated: list[int] = field(default_factory=list)  # tokens read back so far
    launched: int = 0  # tokens whose sampling has been launched on the device
    # with params.logprobs: per token read back, its log-probability and (id, log-probability) alternatives
    scores: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    prompt: Prompt
    seed: int
    kv: KVSlot = field(default_factory=KVSlot)
    vision: VisionWork = field(default_factory=VisionWork)
    cache: CacheState = field(default_factory=CacheState)
    tokens: TokenState = field(default_factory=TokenState)
    abort_requested: bool = False  # stop once its prefill is launched (module docstring)
    grammar: GrammarState | None = None  # its `guided` output's matcher (engines/guided.py)
    added_at: float = field(default_factory=time.perf_counter)
    # perf_counter when it entered each status, launched its vision batch, read its first token
    timeline: dict[str, float] = field(default_factory=dict)
    _status: SeqStatus = field(default=SeqStatus.WAITING, init=False, repr=False)

    @property
    def status(self) -> SeqStatus:
        return self._status

    def move(self, status: SeqStatus) -> None:
        if status not in TRANSITIONS[self._status]:
            raise IllegalTransition(f"sequence {self.id}: {self._status.value} -> {status.value}")
        self._status = status
        self.timeline[status.value] = time.perf_counter()

    @property
    def ended(self) -> bool:
        return self._status in FINAL

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def rank(self) -> int:
        """Its lane's rank (`EngineRequest.priority`): lower is served first."""
        return self.request.priority.rank

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.ids)

    @property
    def max_new(self) -> int:
        return self.request.params.max_new_tokens

    @cached_property
    def penalized(self) -> bool:
        """Some penalty changes its logits: the sampler counts the tokens it has seen."""
        return self.request.params.penalized

    @cached_property
    def top_logprobs(self) -> int | None:
        """Alternatives per token it asks for (0: its token's log-probability alone); None: no logprobs."""
        params = self.request.params
        return params.top_logprobs if params.logprobs else None

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

    def age(self) -> float:
        return time.perf_counter() - self.added_at

    # -- readiness, one property per stage ------------------------------------------------

    @property
    def admissible(self) -> bool:
        """Its inputs are in: pixels resized (a failure is failed by the engine, never admitted),
        prefix keys hashed, disk reads done."""
        pixels = self.vision.pixels
        return pixels.ready and not pixels.failed and self.cache.inputs_ready

    @property
    def images_in_suffix(self) -> bool:
        """Some image's soft tokens are prefilled (they need its embeddings)."""
        return self.cache.first_image < self.num_images

    @property
    def needs_vision(self) -> bool:
        """Prefilled images whose embeddings are not known yet (a vision-cache hit arrives with
        them; images in a cached KV prefix need none)."""
        return self.images_in_suffix and self.vision.embeds is None

    @property
    def wants_decode(self) -> bool:
        return self._status == SeqStatus.DECODE and self.tokens.launched < self.max_new

    @property
    def next_position(self) -> int:
        """Position of the token the next decode step feeds (the last one sampled)."""
        return self.prompt_len + self.tokens.launched - 1

    def prompt_keys(self) -> PromptKeys | None:
        """The prompt's prefix-cache keys (once `cache.keys` is ready); a key job that failed
        leaves the sequence uncached."""
        keys = self.cache.keys
        if keys is not None and keys.failed:
            log.warning("sequence %s: prefix keys failed (%s); not cached", self.id, keys.error)
            self.cache.keys = keys = None
        return keys.value if keys is not None else None
