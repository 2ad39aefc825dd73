"""OpenAI's chat-completion shapes, as far as a captioning service answers them, and the
conversion of a request into a wicore submission."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from wicore.gateway.errors import ApiError
from wicore.gateway.images import image_from_url
from wicore.grammars import grammar_problem
from wicore.producer import Submission
from wicore.schemas import (
    CaptionResult,
    ChatMessage,
    GenerationParams,
    GuidedSpec,
    ImagePart,
    Lane,
    TextPart,
    TokenLogprob,
)
from wicore.schemas import Choice as Sample


class ImageURL(BaseModel):
    url: str = Field(description="A data URI, or an absolute path / file:// URL under the allowed roots.")
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


ContentPart = Annotated[TextContentPart | ImageURLPart, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[ContentPart]
    name: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="Default: any JSON object.")
    strict: bool | None = Field(None, description="Enforced token by token either way.")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]
ANY_OBJECT: dict[str, Any] = {"type": "object"}


# OpenAI request fields wicore does not serve: each is a 400 that names it (rather than a
# silently different answer).
UNSUPPORTED = {
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "parallel_tool_calls": "tool calls",
    "functions": "function calls",
    "function_call": "function calls",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "suffix": "suffixes (fill-in-the-middle)",
    "echo": "echoing the prompt",
    "best_of": "best_of",
}


class UnsupportedFields(BaseModel):
    """The fields of `UNSUPPORTED`: accepted as null (or false), else a 400 naming the field."""

    tools: SkipJsonSchema[Any] = None
    tool_choice: SkipJsonSchema[Any] = None
    parallel_tool_calls: SkipJsonSchema[Any] = None
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None
    modalities: SkipJsonSchema[Any] = None
    prediction: SkipJsonSchema[Any] = None
    web_search_options: SkipJsonSchema[Any] = None

    @field_validator(*UNSUPPORTED.keys() - {"suffix", "echo", "best_of"}, check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unsupported(value, info)


def refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    if value is None or value is False or (name == "modalities" and value == ["text"]):
        return value
    raise ValueError(f"{UNSUPPORTED.get(name, name)} are not supported by wicore; send the request without it")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False  # a last chunk, of no choices, carries the usage


class SamplingRequest(UnsupportedFields):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # default 0: greedy (OpenAI's is 1)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    priority: Lane = Lane.NORMAL


class ChatCompletionRequest(SamplingRequest):
    """OpenAI's chat request body; `top_k`, `ignore_eos` and `priority` are wicore's additions
    (send them through the client's `extra_body`). Unknown fields are an error, as at OpenAI."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, description="Choices, each sampled with its own seed (at most the setting max_n).")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, description="With logprobs: alternatives per token (at most max_logprobs).")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # transformers' (vLLM's extra field too)
    response_format: ResponseFormat | None = None
    guided: dict[str, Any] | None = Field(
        None, description='wicore\'s grammar, as on native jobs: {"json_schema"}, {"regex"} or {"choice"}.'
    )


def check_stream_options(stream: bool, options: StreamOptions | None) -> None:
    if options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")


class CompletionRequest(SamplingRequest):
    """OpenAI's legacy text completion: one text prompt, no images. The prompt goes to the model
    as one user turn of its chat template (wicore's jobs are conversations). `top_k`,
    `ignore_eos` and `priority` are wicore's additions."""

    prompt: str | list[str] = Field(description="One text prompt (a list holds exactly one).")
    suffix: SkipJsonSchema[Any] = None
    echo: SkipJsonSchema[Any] = None
    best_of: SkipJsonSchema[Any] = None

    @field_validator("suffix", "echo", "best_of")
    @classmethod
    def _unsupported_here(cls, value: Any, info: ValidationInfo) -> Any:
        return value if info.field_name == "best_of" and value == 1 else refuse_unsupported(value, info)


def completion_submission(request: CompletionRequest) -> Submission:
    check_supported(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if len(prompts) != 1:
        raise ApiError(400, f"prompt: send one prompt per request (got {len(prompts)})", param="prompt")
    return Submission(prompt=prompts[0], params=generation_params(request), priority=request.priority)


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    system_fingerprint: str | None = None


def text_completion(result: CaptionResult, model: str) -> TextCompletion:
    return TextCompletion(
        id=f"cmpl-{result.job_id}",
        created=int(time.time()),
        model=model,
        choices=[TextChoice(text=result.text, finish_reason=finish_reason(result))],
        usage=usage(result),
    )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "wicore"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> None:
    check_stream_options(request.stream, request.stream_options)
    if request.n != 1 and (request.stream or isinstance(request, CompletionRequest)):
        raise ApiError(400, "n: a streamed request or a text completion has one choice; send n: 1", param="n")


def generation_params(request: ChatCompletionRequest | CompletionRequest) -> GenerationParams:
    fields = {
        "max_new_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "stop": (request.stop,) if isinstance(request.stop, str) else request.stop,
        "ignore_eos": request.ignore_eos or None,
        "stream": request.stream or None,
    }
    if isinstance(request, ChatCompletionRequest):
        fields |= chat_fields(request)
    return GenerationParams(**{k: v for k, v in fields.items() if v is not None})


def chat_fields(request: ChatCompletionRequest) -> dict[str, Any]:
    """What only chat takes: choices, log-probabilities, penalties and a grammar."""
    return {
        "max_new_tokens": request.max_completion_tokens or request.max_tokens,
        "n": request.n,
        "logprobs": request.logprobs,
        "top_logprobs": request.top_logprobs,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "guided": guided_spec(request),
    }


def guided_spec(request: ChatCompletionRequest) -> GuidedSpec | None:
    """`response_format` (OpenAI's) or `guided` (wicore's) as the job's grammar; a 400 naming
    the field when it is malformed or both are given."""
    fmt = request.response_format
    constrained = fmt is not None and not isinstance(fmt, TextFormat)
    if constrained and request.guided is not None:
        raise ApiError(400, "guided: give response_format or guided, not both", param="guided")
    if request.guided is not None:
        return _spec(request.guided, "guided")
    if isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_
        return _spec({"json_schema": ANY_OBJECT if schema is None else schema}, "response_format.json_schema.schema")
    if isinstance(fmt, JsonObjectFormat):
        return _spec({"json_schema": ANY_OBJECT}, "response_format")
    return None


def _spec(value: dict[str, Any], param: str) -> GuidedSpec:
    try:
        spec = GuidedSpec.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{param}: {where + ': ' if where else ''}{first['msg']}", param=param) from None
    problem = grammar_problem(spec)
    if problem is not None:
        raise ApiError(400, f"{param}: {problem}", param=param)
    return spec


def chat_submission(request: ChatCompletionRequest, roots: tuple[Path, ...], *, streams: bool = False) -> Submission:
    """The request as a wicore submission: its image parts, in order, become the job's images
    (any number, none too; the producer holds them to max_images_per_request). `streams`: the
    caller answers `stream: true` (a batch line cannot)."""
    check_supported(request)
    if request.stream and not streams:
        raise ApiError(400, "stream: a batch line is answered whole; send stream: false", param="stream")
    images: list[bytes | Path | str] = []
    messages = tuple(_message(m, i, images, roots) for i, m in enumerate(request.messages))
    return Submission(
        messages=messages, images=tuple(images), params=generation_params(request), priority=request.priority
    )


def _message(message: Message, index: int, images: list, roots: tuple[Path, ...]) -> ChatMessage:
    role = "system" if message.role == "developer" else message.role
    if isinstance(message.content, str):
        return ChatMessage(role=role, content=message.content)
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(message.content):
        if isinstance(part, TextContentPart):
            parts.append(TextPart(text=part.text))
        elif message.role != "user":
            raise ApiError(400, f"messages.{index}.content.{j}: image parts go in user messages", param="messages")
        else:
            images.append(image_from_url(part.image_url.url, roots, f"messages.{index}.content.{j}.image_url.url"))
            parts.append(ImagePart())
    return ChatMessage(role=role, content=parts)


def finish_reason(result: CaptionResult | Sample) -> Literal["stop", "length"]:
    return "length" if result.finish_reason == "length" else "stop"


def choices(result: CaptionResult) -> list[ChatCompletionChoice]:
    """One choice per sample (n of them), in index order."""
    samples = result.choices or (
        Sample(index=0, **result.model_dump(include={"text", "finish_reason", "token_ids", "logprobs"})),
    )
    return [
        ChatCompletionChoice(
            index=sample.index,
            message=AssistantMessage(content=sample.text),
            finish_reason=finish_reason(sample),
            logprobs=None if sample.logprobs is None else ChoiceLogprobs(content=list(sample.logprobs)),
        )
        for sample in samples
    ]


def chat_completion(result: CaptionResult, model: str) -> ChatCompletion:
    return ChatCompletion(
        id=f"chatcmpl-{result.job_id}",
        created=int(time.time()),
        model=model,
        choices=choices(result),
        usage=usage(result),
    )


def usage(result: CaptionResult) -> Usage:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.output_tokens,
        total_tokens=result.prompt_tokens + result.output_tokens,
    )
