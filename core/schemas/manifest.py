"""A line of a JSONL manifest given to `wicore caption` or `wicore enqueue`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from wicore.schemas.base import Strict, Text, shallow
from wicore.schemas.chat import ChatMessage, ImagePart, TextPart, check_conversation
from wicore.schemas.generation import (
    GENERATION_KEYS,
    GenerationParams,
    MaxNewTokens,
    Penalty,
    RepetitionPenalty,
    Samples,
    Seed,
    Stops,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)
from wicore.schemas.guided import GuidedSpec
from wicore.schemas.job import DEFAULT_PROMPT


class ManifestImagePart(Strict):
    type: Literal["image"] = "image"
    image: str = Field(
        min_length=1,
        description="Image file (a relative path is relative to the manifest's folder), or an http(s):// or s3:// "
        "URL the worker fetches.",
    )


class ManifestMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[Annotated[TextPart | ManifestImagePart, Field(discriminator="type")]]

    def chat_message(self) -> ChatMessage:
        """The turn as a job holds it: its image parts name no file (the job's images do, in order)."""
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        parts = [part if isinstance(part, TextPart) else ImagePart() for part in self.content]
        return ChatMessage(role=self.role, content=parts)

    @property
    def images(self) -> list[str]:
        return (
            [] if isinstance(self.content, str) else [p.image for p in self.content if isinstance(p, ManifestImagePart)]
        )


class ManifestEntry(Strict):
    """One line of a JSONL manifest given to `wicore caption` or `wicore enqueue`: an `image` and
    its `prompt`, a `prompt` alone (text only), or chat `messages`. Generation parameters sit at
    the top level or under `params` (not both for one key); anything else of the caller's goes
    under `metadata`; any other key is an error."""

    model_config = ConfigDict(title="wicore manifest line")

    image: str | None = Field(
        None,
        min_length=1,
        description="Image file (a relative path is relative to the manifest's folder), or an http(s):// or s3:// "
        "URL the worker fetches.",
    )
    prompt: Text | None = Field(None, description=f"Prompt (default with an image: {DEFAULT_PROMPT!r}).")
    messages: list[ManifestMessage] | None = Field(
        None,
        description="Chat turns instead of image and prompt (system, user, assistant; the last the user's). "
        'A user turn\'s content is text or a list of parts: {"type": "text", "text": ...} and '
        '{"type": "image", "image": FILE or URL}, any number, in any order.',
    )
    input: str | None = Field(
        None, description="Key of the result line (default: `image` as written, else the first image, else FILE:LINE)."
    )
    max_new_tokens: MaxNewTokens | None = Field(None, description="Most tokens to generate.")
    temperature: Temperature | None = Field(None, description="0 = greedy; above 0 samples.")
    top_p: TopP | None = None
    top_k: TopK | None = Field(None, description="0 = off.")
    seed: Seed | None = Field(None, description="Sampling seed: the same text every time.")
    stop: Text | Stops | None = Field(None, description="A stop string, or a list of them.")
    n: Samples | None = Field(None, description="Samples of this line (at most the setting max_n); 1 by default.")
    logprobs: bool | None = Field(None, description="Each generated token's log-probability.")
    top_logprobs: TopLogprobs | None = Field(
        None, description="With logprobs: the most likely tokens at each position (at most max_logprobs)."
    )
    presence_penalty: Penalty | None = Field(None, description="OpenAI's, -2..2: once per token generated before.")
    frequency_penalty: Penalty | None = Field(None, description="OpenAI's, -2..2: per time a token was generated.")
    repetition_penalty: RepetitionPenalty | None = Field(
        None, description="transformers', > 0 (1 = off): divides the logits of prompt and output tokens."
    )
    guided: GuidedSpec | None = Field(
        None,
        description='The output\'s grammar, one of {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}: '
        "enforced token by token (docs/guides/structured-outputs.md).",
    )
    params: GenerationParams | None = Field(None, description="The generation parameters as one object.")
    metadata: Annotated[dict[str, Any], BeforeValidator(shallow)] = Field(
        {}, description="Anything of yours: kept with the job, not part of its id."
    )

    @model_validator(mode="after")
    def _one_request_shape(self) -> ManifestEntry:
        if self.messages is not None and (self.image is not None or self.prompt is not None):
            raise ValueError("give messages, or image and/or prompt, not both")
        if self.messages is None and self.image is None and self.prompt is None:
            raise ValueError("give an image, a prompt or messages")
        if self.messages is not None:
            check_conversation([m.chat_message() for m in self.messages])
        return self

    @property
    def images(self) -> list[str]:
        """Every image (file or URL) the line names, in conversation order."""
        if self.messages is not None:
            return [image for message in self.messages for image in message.images]
        return [] if self.image is None else [self.image]

    @model_validator(mode="after")
    def _each_parameter_once(self) -> ManifestEntry:
        nested = self.params.model_fields_set if self.params is not None else set()
        twice = sorted(key for key in GENERATION_KEYS if getattr(self, key) is not None and key in nested)
        if twice:
            raise ValueError(f"{', '.join(twice)} given both at the top level and under params")
        return self

    def generation(self, defaults: dict[str, Any] | None = None) -> GenerationParams:
        """The line's parameters over `defaults` (the command's flags)."""
        top = {key: getattr(self, key) for key in GENERATION_KEYS if getattr(self, key) is not None}
        if isinstance(top.get("stop"), str):
            top["stop"] = (top["stop"],)
        nested = self.params.model_dump(exclude_unset=True) if self.params is not None else {}
        return GenerationParams.model_validate({**(defaults or {}), **nested, **top})
