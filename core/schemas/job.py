"""A caption job, the payload of every wicore RQ job, and its content-derived id."""

from __future__ import annotations

import hashlib
import json
import time
from enum import Enum
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_serializer, model_validator

from wicore.schemas.base import Strict, Text, shallow
from wicore.schemas.chat import ChatMessage, check_conversation
from wicore.schemas.generation import GenerationParams
from wicore.schemas.images import ImageRef

DEFAULT_PROMPT = "Describe this image in detail."
# Model ids appear in queue names (scheduler.buckets), so no dots, colons or spaces.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


class Lane(str, Enum):
    """Priority lanes, drained in this order."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        return list(Lane).index(self)


class CaptionJob(Strict):
    """A conversation with any number of images (0 too) -> text. The payload of every wicore RQ
    job. `images` are the conversation's image parts, in order: those of `messages`, or, with a
    `prompt` (or neither), one user turn of the images then the prompt's text."""

    images: tuple[ImageRef, ...] = ()
    prompt: Text | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: GenerationParams = GenerationParams()
    model: str = Field(pattern=MODEL_ID_PATTERN, max_length=64)
    priority: Lane = Lane.NORMAL
    deadline: float | None = None  # unix seconds; past it the job fails unrun
    metadata: Annotated[dict[str, Any], BeforeValidator(shallow)] = {}
    submitted_at: float = Field(default_factory=time.time)
    # Random for an unseeded sampled request (`Producer.prepare`): each is a job of its own, never
    # deduplicated onto an earlier sample.
    nonce: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")

    @field_serializer("params")
    def _set_params_only(self, params: GenerationParams) -> dict[str, Any]:
        return params.model_dump(mode="json", exclude_unset=True)

    @model_validator(mode="before")
    @classmethod
    def _one_image_shorthand(cls, data: Any) -> Any:
        """`image`: one image, as `images` of one."""
        if isinstance(data, dict) and "image" in data:
            if "images" in data:
                raise ValueError("give image or images, not both")
            data = {**data, "images": [data["image"]]}
            del data["image"]
        return data

    @model_validator(mode="after")
    def _images_match_the_chat(self) -> CaptionJob:
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give either prompt or messages, not both")
        if self.messages is None:
            if not self.images and self.prompt is None:
                raise ValueError("a job needs a prompt, messages or an image")
            return self
        check_conversation(self.messages)
        parts = sum(m.image_count for m in self.messages)
        if parts != len(self.images):
            raise ValueError(f"messages hold {parts} image parts for {len(self.images)} images")
        return self

    def chat(self) -> list[dict[str, Any]]:
        """The conversation in Hugging Face chat-template form."""
        if self.messages is not None:
            return [m.model_dump(mode="json") for m in self.messages]
        if not self.images:
            return [{"role": "user", "content": [{"type": "text", "text": self.prompt}]}]
        text = self.prompt if self.prompt is not None else DEFAULT_PROMPT
        content = [{"type": "image"} for _ in self.images] + [{"type": "text", "text": text}]
        return [{"role": "user", "content": content}]

    @property
    def job_id(self) -> str:
        return job_id_for(self)


def job_id_for(job: CaptionJob) -> str:
    """Content-derived id: the same images, conversation, parameters and model give the same id,
    so resubmitting the same work is deduplicated. Priority, deadline and metadata do not count;
    a parameter left to the checkpoint's default differs from one set (they may sample apart).
    A one-image job keeps the `image` key its id has always been made of."""
    identities = [image.identity for image in job.images]
    work: dict[str, Any] = {
        "chat": job.chat(),
        "params": job.params.model_dump(mode="json", exclude_unset=True),
        "model": job.model,
    }
    if len(identities) == 1:
        work["image"] = identities[0]
    else:
        work["images"] = identities
    if job.nonce is not None:
        work["nonce"] = job.nonce
    canonical = json.dumps(work, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "wc-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]
