"""The engine interface: requests in, one completion (text or error) per request out.

An engine owns a model on a device. The worker feeds it with `add` whenever it reports free
slots and calls `step` until it has nothing left; each `step` returns the requests that ended
during it. A static-batch engine (reference) finishes everything it holds in one step; a
continuous-batching engine (fast) returns sequences as they end and takes new ones between
steps. Engines never import Redis or RQ.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from wicore.schemas import FinishReason, GenerationParams

if TYPE_CHECKING:
    from PIL import Image


@dataclass
class EngineRequest:
    id: str
    chat: list[dict[str, Any]]  # HF chat-template messages; one {"type": "image"} per image
    images: list[Image.Image]  # decoded RGB images, in the order of the image parts
    params: GenerationParams
    image_hashes: list[str] = field(default_factory=list)  # sha256 of each image's bytes (caches)


@dataclass
class Completion:
    id: str
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    error: str | None = None
    input_error: bool = False  # the request's own fault: fail it, never retry
    engine_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def failed(request_id: str, error: BaseException | str, *, input_error: bool) -> Completion:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return Completion(id=request_id, error=message, input_error=input_error)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    max_batch_size: int = 8
    seed: int = 0  # for config-only checkpoints whose weights are seeded at load time
    cache: bool = True  # the engine's KV / vision-embedding caches (`--no-cache` turns them off)
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific, validated by the engine


class Engine(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: EngineConfig):
        self.config = config
        self.requests_seen = 0  # every request ever passed to `add` (stats; tests use it too)

    @property
    def model_id(self) -> str:
        from pathlib import Path

        return Path(self.config.model_dir).name

    @abc.abstractmethod
    def add(self, requests: list[EngineRequest]) -> list[Completion]:
        """Take requests; return at once the ones rejected (bad input), as failed completions."""

    @abc.abstractmethod
    def step(self) -> list[Completion]:
        """Advance the work in hand; return every request that ended during this step."""

    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests taken and not yet returned."""

    def abort(self, request_ids: list[str]) -> list[Completion]:
        """Stop these requests at the next step boundary; engines that cannot stop early return []."""
        return []

    def free_slots(self) -> int:
        return max(0, self.config.max_batch_size - self.num_unfinished())

    def attach_vision_cache(self, store) -> None:
        """A shared image-embedding store (the worker's Redis layer). Engines without a vision
        cache ignore it."""

    def stats(self) -> dict[str, Any]:
        """Counters for `wicore status` and benchmarks; engines add their own."""
        return {"requests_seen": self.requests_seen, "unfinished": self.num_unfinished()}

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        """Run `requests` to the end; completions in request order."""
        done = {c.id: c for c in self.add(requests)}
        while self.num_unfinished():
            done.update((c.id, c) for c in self.step())
        return [done[r.id] for r in requests]

    def close(self) -> None:
        """Release the device. Engines hold no other resources."""


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
