"""The native API's request and response bodies (documented at /docs from these schemas)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from wicore.grammars import grammar_problem
from wicore.schemas import MODEL_ID_PATTERN, CaptionResult, GenerationParams, GuidedSpec, Lane, TextPart


class JobImagePart(BaseModel):
    """An image part of a native request's message. It names its image (`image`, `image_path` or
    `image_url`), or names none and takes the request's own image (`image`, `image_path`,
    `image_url` or the upload)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image"] = "image"
    image: str | None = Field(None, description="The image's bytes, base64 or a data URI.")
    image_path: str | None = Field(None, description="Or an absolute path under the allowed roots.")
    image_url: str | None = Field(None, description="Or an http(s):// or s3:// URL; a worker fetches it.")

    @model_validator(mode="after")
    def _at_most_one_source(self) -> JobImagePart:
        if sum(value is not None for value in (self.image, self.image_path, self.image_url)) > 1:
            raise ValueError("give an image part at most one of image, image_path and image_url")
        return self

    @property
    def named(self) -> bool:
        return self.image is not None or self.image_path is not None or self.image_url is not None


class JobMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | JobImagePart, Field(discriminator="type")]]


class JobFields(BaseModel):
    """A job's fields besides its image (a multipart upload sends them as form fields)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, description="Default with an image: 'Describe this image in detail.'")
    messages: list[JobMessage] | None = Field(
        None, description="Chat turns instead of a prompt; user turns hold any number of image parts, none too."
    )
    params: GenerationParams = Field(default_factory=GenerationParams)
    guided: GuidedSpec | None = Field(
        None,
        description='The output\'s grammar, one of {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}; '
        "part of the job's id (params.guided is the same field).",
    )
    model: str | None = Field(None, pattern=MODEL_ID_PATTERN, max_length=64, description="Default: the gateway's.")
    priority: Lane = Lane.NORMAL
    deadline: float | None = Field(None, description="Unix seconds; a job not started by then fails unrun.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Kept with the job; not part of its id.")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> JobFields:
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give either prompt or messages, not both")
        return self

    @field_validator("guided")
    @classmethod
    def _guided_compiles(cls, guided: GuidedSpec | None) -> GuidedSpec | None:
        problem = None if guided is None else grammar_problem(guided)
        if problem is not None:
            raise ValueError(problem)
        return guided

    @field_validator("params")
    @classmethod
    def _params_guided_compiles(cls, params: GenerationParams) -> GenerationParams:
        problem = None if params.guided is None else grammar_problem(params.guided)
        if problem is not None:
            raise ValueError(f"guided: {problem}")
        return params

    @model_validator(mode="after")
    def _guided_in_params(self) -> JobFields:
        """`guided` moves into `params` (given once): the job's grammar, part of its id."""
        if self.guided is not None:
            if self.params.guided is not None:
                raise ValueError("guided: give it at the top level or under params, not both")
            given = self.params.model_dump(exclude_unset=True)
            self.params = GenerationParams.model_validate({**given, "guided": self.guided})
        return self


class JobRequest(JobFields):
    """One job: a `prompt` (with the image as `image` (base64 or a data URI), `image_path` or
    `image_url`, or no image for text only), or chat `messages` whose image parts name their
    images (or take the request's one image); the rest is optional."""

    image: str | None = Field(None, description="The image's bytes, base64 or a data URI (data:image/png;base64,...).")
    image_path: str | None = Field(None, description="Or an absolute path under the allowed roots.")
    image_url: str | None = Field(
        None, description="Or an http(s):// or s3:// URL; a worker fetches it, under its URL policy."
    )

    @model_validator(mode="after")
    def _at_most_one_image_source(self) -> JobRequest:
        given = [self.image, self.image_path, self.image_url]
        if sum(value is not None for value in given) > 1:
            raise ValueError("give at most one of image (base64 or data URI), image_path and image_url")
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
