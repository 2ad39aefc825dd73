"""The engine interface: requests in, one completion (text or error) per request out.

An engine owns a model on a device. The worker feeds it with `add` whenever it reports free
slots and calls `step` until it has nothing left; each `step` returns the requests that ended
during it. A static-batch engine (reference) finishes everything it holds in one step; a
continuous-batching engine (fast) returns sequences as they end and takes new ones between
steps. `abort` cancels requests between steps. Engines never import Redis or RQ.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from wicore import defaults
from wicore.engines.options import FastOptions
from wicore.engines.samples import SampleGroups
from wicore.errors import ConfigError
from wicore.schemas import FinishReason, GenerationParams, Lane, TokenLogprob

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from wicore.ops.image_preprocess import PreprocessSpec


@dataclass
class EngineRequest:
    id: str
    chat: list[dict[str, Any]]  # HF chat-template messages; one {"type": "image"} per image
    # Decoded RGB images in the order of the image parts; or, for an engine with a `pixel_spec`,
    # uint8 [H, W, 3] arrays already resized by it (`wicore.ops.image_preprocess.resized_images`).
    images: list[Image.Image | np.ndarray]
    params: GenerationParams
    image_hashes: list[str] = field(default_factory=list)  # sha256 of each image's bytes (caches)
    priority: Lane = Lane.NORMAL  # its job's lane: an engine serves a better lane first


@dataclass
class Completion:
    id: str
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    error: str | None = None
    input_error: bool = False  # the request's own fault: fail it, never retry
    out_of_memory: bool = False  # the device ran out of memory: run it again in a smaller batch
    engine_s: float = 0.0
    first_token_s: float | None = None  # in the engine -> its first token read back (None: not measured)
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per token of `token_ids`
    samples: list[Completion] = field(default_factory=list)  # params.n > 1: every sample, this one first

    @property
    def ok(self) -> bool:
        return self.error is None


def reject_options(config: EngineConfig, engine: str) -> None:
    """For engines that take no options: a given option is an error, never silently ignored."""
    defaults = FastOptions().model_dump()
    given = sorted(k for k, v in config.options.model_dump().items() if v != defaults[k])
    if given:
        names = ", ".join(given)
        raise ConfigError(f"the {engine} engine takes no --engine-option (got {names}); they are for --engine fast")


def failed(request_id: str, error: BaseException | str, *, input_error: bool) -> Completion:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    oom = not isinstance(error, str) and is_out_of_memory(error)
    return Completion(id=request_id, error=message, input_error=input_error, out_of_memory=oom)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's torch.OutOfMemoryError, Python's MemoryError, or PyTorch's CPU allocator refusing
    memory (a plain RuntimeError). Matched by name: this module does not import torch."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


ABORTED = "aborted: the request was canceled before it finished"


def aborted(request_id: str, prompt_tokens: int = 0, engine_s: float = 0.0) -> Completion:
    """The completion of a request `Engine.abort` stopped: an error, never retried."""
    return Completion(request_id, error=ABORTED, input_error=True, prompt_tokens=prompt_tokens, engine_s=engine_s)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    max_batch_size: int = defaults.BATCH_SIZE
    seed: int = 0  # for config-only checkpoints whose weights are seeded at load time
    cache: bool = True  # the engine's KV / vision-embedding caches (`--no-cache` turns them off)
    options: FastOptions = field(default_factory=FastOptions)  # the fast engine's; the others take none


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
        """Advance the work in hand; return every request that ended during this step. A step
        that fails (out of memory, a device error) returns its requests as failed completions
        (`failed`), or raises having dropped every request it held."""

    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests taken and not yet returned."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Cancel requests taken and not yet returned (call it between steps). Returns a
        completion (error `ABORTED`) for each request stopped now; an engine may stop one later
        instead, and then a later `step` returns it. Ids it does not hold are ignored."""

    def handover_size(self) -> int:
        """Requests the worker hands over in one `add` once all their images are ready, so the
        engine starts on them while the rest of a claim loads: a vision batch for an engine with
        a vision tower (its resolved `vision_batch_size`), else all it holds."""
        return self.config.max_batch_size

    def free_slots(self) -> int:
        return max(0, self.config.max_batch_size - self.num_unfinished())

    def pixel_spec(self) -> PreprocessSpec | None:
        """How this engine resizes images, for callers that resize them beforehand (the worker's
        decode processes); None: it takes decoded images only."""
        return None

    def image_size(self) -> tuple[int, int] | None:
        """The (height, width) this engine resizes every image to, if one; the worker's decoders
        shrink far larger images to near it as they decode. None: images are decoded whole."""
        spec = self.pixel_spec()
        return None if spec is None else spec.size

    def attach_vision_cache(self, store) -> None:
        """A shared image-embedding store (the worker's Redis layer). Engines without a vision
        cache ignore it."""

    def describe(self) -> dict[str, Any]:
        """What this engine runs with, every default resolved (the worker logs it at start)."""
        c = self.config
        return {"name": self.name, "device": c.device, "dtype": c.dtype, "max_batch_size": c.max_batch_size}

    def stats(self) -> dict[str, Any]:
        """Counters for `wicore status` and benchmarks; engines add their own."""
        return {"requests_seen": self.requests_seen, "unfinished": self.num_unfinished()}

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        """Run `requests` to the end (n samples each); completions in request order."""
        samples = SampleGroups()
        done = {c.id: c for c in samples.merge(self.add(samples.split(requests)))}
        while self.num_unfinished():
            done.update((c.id, c) for c in samples.merge(self.step()))
        return [done[r.id] for r in requests]

    def close(self) -> None:
        """Release the device; what a cache writes behind (the shared vision cache) is written first."""


class StaticBatchEngine(Engine):
    """An engine whose `step` runs every request it holds to the end: between steps no request
    has started, so `abort` drops the requests it names at once."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.pending: list[EngineRequest] = []

    def add(self, requests: list[EngineRequest]) -> list[Completion]:
        self.requests_seen += len(requests)
        self.pending.extend(requests)
        return []

    def num_unfinished(self) -> int:
        return len(self.pending)

    def take_pending(self) -> list[EngineRequest]:
        """The requests of the next step, in arrival order."""
        requests, self.pending = self.pending, []
        return requests

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        wanted = set(request_ids)
        stopped = [r for r in self.pending if r.id in wanted]
        self.pending = [r for r in self.pending if r.id not in wanted]
        return [aborted(r.id) for r in stopped]


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
