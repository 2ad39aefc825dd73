"""What a caller hands to the producer, and how the producer enqueues it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wicore.schemas import ChatMessage, GenerationParams, Lane


@dataclass(frozen=True)
class Submission:
    image: str | Path | bytes  # a file path, or the image's bytes
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: Lane = Lane.NORMAL
    deadline: float | None = None  # unix seconds
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProducerConfig:
    by_path: bool = False  # send paths (workers must see the same files) instead of blobs
    result_ttl_s: int = 86_400  # results (and the dedup mark) live this long
    failure_ttl_s: int = 7 * 86_400
    blob_ttl_s: int = 86_400
    retries: int = 2  # re-runs after a transient failure or a dead worker
    job_timeout_s: int = 3_600
    max_image_bytes: int = 32 * 2**20
    notify: bool = True  # workers push each ended job to this producer's list (`wait` reads it)
