"""One request's life in the fast engine."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from wicore.engines.base import Completion, EngineRequest
from wicore.engines.fast.inputs import Prompt


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
    pixels: Future | np.ndarray | None  # [num_images, 3, H, W] float32 (a Future while resized)
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
    def needs_vision(self) -> bool:
        """Images whose embeddings are not known yet (a cache hit arrives with them)."""
        return self.num_images > 0 and self.image_embeds is None

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
