"""What a caller hands to the producer, and how the producer enqueues it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from wicore import defaults
from wicore.redaction import masked_url
from wicore.schemas import CaptionJob, ChatMessage, GenerationParams, Lane


@dataclass(frozen=True)
class Submission:
    image: str | Path | bytes  # a file path, an http(s):// or s3:// URL (the worker fetches it), or the bytes
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: Lane = Lane.NORMAL
    deadline: float | None = None  # unix seconds
    metadata: dict[str, Any] = field(default_factory=dict)
    name: str | None = None  # for people (the job's description in rq-dashboard); default: the path

    @property
    def label(self) -> str | None:
        if self.name is not None:
            return self.name
        if isinstance(self.image, str | Path):
            return masked_url(str(self.image))  # a path passes unchanged
        return None


class Prepared(NamedTuple):
    """A submission made into its job (`Producer.prepare`), ready to enqueue."""

    job: CaptionJob
    blob: bytes | None  # the image bytes when they travel as a blob
    label: str | None  # the submission's `label`: the job's description


@dataclass(frozen=True)
class ProducerConfig:
    by_path: bool = False  # send paths (workers must see the same files) instead of blobs
    result_ttl_s: int = defaults.RESULT_TTL_S  # results (and the dedup mark) live this long
    failure_ttl_s: int = 7 * 86_400
    blob_ttl_s: int = 86_400
    retries: int = defaults.RETRIES  # re-runs after a transient failure or a dead worker
    job_timeout_s: int = 3_600
    max_image_bytes: int = defaults.MAX_IMAGE_BYTES
    notify: bool = True  # workers push each ended job to this producer's list (`wait` reads it)
