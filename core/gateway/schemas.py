"""The native API's request and response bodies (documented at /docs from these schemas)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wicore.schemas import MODEL_ID_PATTERN, CaptionResult, ChatMessage, GenerationParams, Lane


class JobFields(BaseModel):
    """A job's fields besides its image (a multipart upload sends them as form fields)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, description="Default: 'Describe this image in detail.'")
    messages: list[ChatMessage] | None = Field(None, description="Chat turns instead of a prompt; one image part.")
    params: GenerationParams = Field(default_factory=GenerationParams)
    model: str | None = Field(None, pattern=MODEL_ID_PATTERN, max_length=64, description="Default: the gateway's.")
    priority: Lane = Lane.NORMAL
    deadline: float | None = Field(None, description="Unix seconds; a job not started by then fails unrun.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Kept with the job; not part of its id.")


class JobRequest(JobFields):
    """One caption job. Give the image as `image` (base64 or a data URI), `image_path` or
    `image_url`, and a `prompt` or chat `messages` (with exactly one image part); the rest is optional."""

    image: str | None = Field(None, description="The image's bytes, base64 or a data URI (data:image/png;base64,...).")
    image_path: str | None = Field(None, description="Or an absolute path under the allowed roots.")
    image_url: str | None = Field(
        None, description="Or an http(s):// or s3:// URL; a worker fetches it, under its URL policy."
    )

    @model_validator(mode="after")
    def _one_image_source(self) -> JobRequest:
        given = [self.image, self.image_path, self.image_url]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of image (base64 or data URI), image_path and image_url")
        return self


class JobAccepted(BaseModel):
    job_id: str = Field(description="Derived from the work: the same request gives the same id.")
    status_url: str
    model: str


class JobView(BaseModel):
    job_id: str
    status: str = Field(description="RQ's status: queued, started, finished, failed, canceled, ...")
    result: CaptionResult | None = None
    error: str | None = None


class CancelReply(BaseModel):
    job_id: str
    status: str = Field(description="'canceled', or the status the job had already ended with.")


class BatchLine(BaseModel):
    """One line of a batch: its job id, or what was wrong with it."""

    index: int
    custom_id: str | None = None
    job_id: str | None = None
    error: str | None = None


class BatchReply(BaseModel):
    jobs: list[BatchLine]
    accepted: int
    rejected: int


class OpenAIBatchLine(BaseModel):
    """A line of an OpenAI batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str | None = None
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/jobs"]
    body: dict[str, Any]
