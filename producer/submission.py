"""What a caller hands to the producer, and how the producer enqueues it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from wicore import defaults
from wicore.errors import BadGrammar
from wicore.redaction import masked_url
from wicore.schemas import CaptionJob, ChatMessage, GenerationParams, GuidedSpec, Lane, SamplingLimits

ImageInput = str | Path | bytes  # an image reference (prepare_image reads it) or the image's bytes


@dataclass(frozen=True)
class Submission:
    """What to run: a conversation (`messages`, or a `prompt`, or neither for the default prompt)
    and its images in the order of its image parts. `Submission(image, prompt)` is one image
    then the prompt; `Submission(prompt="...")` is text only. Each image is a file path, an
    http(s):// or s3:// URL (the worker fetches it), or the bytes."""

    image: ImageInput | None = None  # one image: shorthand for `images` of one (it goes first)
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: Lane = Lane.NORMAL
    deadline: float | None = None  # unix seconds
    metadata: dict[str, Any] = field(default_factory=dict)
    name: str | None = None  # for people (the job's description in rq-dashboard); default: the first image
    images: tuple[ImageInput, ...] = ()
    guided: GuidedSpec | None = None  # the output's grammar: shorthand for params.guided

    @property
    def generation(self) -> GenerationParams:
        """`params` with `guided` in them (given in one place or the other, not both)."""
        if self.guided is None:
            return self.params
        if self.params.guided is not None:
            raise BadGrammar("guided: give it on the submission or in its params, not both")
        return GenerationParams.model_validate({**self.params.model_dump(exclude_unset=True), "guided": self.guided})

    @property
    def all_images(self) -> tuple[ImageInput, ...]:
        return self.images if self.image is None else (self.image, *self.images)

    @property
    def label(self) -> str | None:
        if self.name is not None:
            return self.name
        named = [str(i) for i in self.all_images if not isinstance(i, bytes | bytearray | memoryview)]
        return masked_url(named[0]) if named else None  # a path passes unchanged


class Prepared(NamedTuple):
    """A submission made into its job (`Producer.prepare`), ready to enqueue."""

    job: CaptionJob
    blobs: dict[str, bytes]  # sha256 -> bytes of each image that travels as a blob
    label: str | None  # the submission's `label`: the job's description


@dataclass(frozen=True)
class ProducerConfig:
    by_path: bool = False  # send paths (workers must see the same files) instead of blobs
    result_ttl_s: int = defaults.RESULT_TTL_S  # results (and the dedup mark) live this long
    failure_ttl_s: int = 7 * 86_400
    blob_ttl_s: int = 86_400
    # A job's blobs leave Redis at its end, with their last user (`keys.BLOB_USERS`), instead of
    # after blob_ttl_s: what bulk runs need to keep Redis within their window. It costs a chunk
    # 2 commands per distinct blob, and a worker's settle of a batch 2 per distinct blob its jobs used.
    release_blobs: bool = False
    retries: int = defaults.RETRIES  # re-runs after a transient failure or a dead worker
    job_timeout_s: int = 3_600
    max_image_bytes: int = defaults.MAX_IMAGE_BYTES
    max_images_per_request: int = defaults.MAX_IMAGES_PER_REQUEST
    sampling: SamplingLimits = field(default_factory=SamplingLimits)  # max_n, max_logprobs
    notify: bool = True  # workers push each ended job to this producer's list (`wait` reads it)
    # Admission control (admission.py): queued jobs per lane of the model past which `QueueFull` is raised; 0: none.
    max_queued_jobs: int = 0  # the normal and low lanes, each
    max_queued_high_jobs: int = 0  # the high lane
