"""What crosses a process or Redis boundary: caption jobs and their results (pydantic, JSON).

Nothing here imports Redis, RQ or torch, so the producer, the scheduler, the worker and the
engines all share these definitions.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
    model_validator,
)

from wicore import defaults
from wicore.errors import OverLimit

DEFAULT_PROMPT = "Describe this image in detail."
SHA256_HEX = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def unicode_text(value: str) -> str:
    """JSON can carry a lone surrogate (an unpaired \\ud800); UTF-8, hashes and tokenizers cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text holds a lone surrogate: not valid Unicode") from None
    return value


def file_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path cannot hold a NUL byte")
    return unicode_text(value)


MAX_METADATA_DEPTH = 32  # lists and objects inside each other; deeper JSON costs recursion in every reader


def nesting_depth(value: Any, stop_after: int) -> int:
    """How many lists/dicts deep `value` goes ({"a": [1]} is 2), counted up to `stop_after` + 1,
    level by level (no recursion, however deep the value)."""
    depth, level = 0, [value]
    while depth <= stop_after:
        level = [v for v in level if isinstance(v, dict | list | tuple)]
        if not level:
            break
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def shallow(value: Any) -> Any:
    if nesting_depth(value, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels of lists and objects")
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
FilePath = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(file_path)]
# Model ids appear in queue names (scheduler.buckets), so no dots, colons or spaces.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


class Strict(BaseModel):
    """Unknown keys fail loudly; instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Lane(str, Enum):
    """Priority lanes, drained in this order."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        return list(Lane).index(self)


URL_SCHEMES = ("http", "https", "s3")


def image_url(value: str) -> str:
    """http(s)://host/... or s3://bucket/key; what may be fetched is the worker's policy."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme.lower() not in URL_SCHEMES:
        raise ValueError(f"URL scheme {parts.scheme!r} is not fetched: use http://, https:// or s3://")
    if not parts.hostname:
        raise ValueError("the URL names no host (or bucket)")
    if parts.scheme.lower() == "s3" and not parts.path.strip("/"):
        raise ValueError("an s3:// URL needs a key: s3://bucket/key")
    return unicode_text(value)


ImageUrl = Annotated[str, Field(min_length=1, max_length=8192), AfterValidator(image_url)]


class ImageRef(Strict):
    """An image by reference: a path under the worker's allowed roots, a blob the producer
    stored in Redis under its sha256, or a URL the worker fetches. The hash is always the hash
    of the image's bytes; a URL's is known only once the worker has fetched it (None here)."""

    sha256: SHA256_HEX | None = None
    path: FilePath | None = None
    url: ImageUrl | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ImageRef:
        if self.url is not None and (self.path is not None or self.sha256 is not None):
            raise ValueError("an image by url carries neither a path nor a sha256")
        if self.url is None and self.sha256 is None:
            raise ValueError("an image needs its sha256 (or a url)")
        return self

    @property
    def is_blob(self) -> bool:
        return self.path is None and self.url is None

    @property
    def identity(self) -> str:
        """What the job id hashes: the bytes' sha256, or the URL as given (the producer fetches
        nothing; the worker's caches key a URL's image by its fetched bytes' sha256)."""
        return self.sha256 if self.sha256 is not None else f"url:{self.url}"


class TextPart(Strict):
    type: Literal["text"] = "text"
    text: Text


class ImagePart(Strict):
    type: Literal["image"] = "image"


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart | ImagePart]

    @property
    def image_count(self) -> int:
        if isinstance(self.content, str):
            return 0
        return sum(isinstance(part, ImagePart) for part in self.content)


def check_conversation(messages: Sequence[ChatMessage]) -> None:
    """A conversation the model can answer: at least one turn, the last a user's, images only in
    user turns."""
    if not messages:
        raise ValueError("messages: give at least one turn")
    if messages[-1].role != "user":
        raise ValueError(f"messages: the last turn must be the user's, not the {messages[-1].role}'s")
    for index, message in enumerate(messages):
        if message.role != "user" and message.image_count:
            raise ValueError(f"messages.{index}: image parts go in user turns, not {message.role} turns")


MaxNewTokens = Annotated[int, Field(ge=1, le=32_768)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]  # 0 = greedy
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]  # 0 = off
Seed = Annotated[int, Field(ge=0, lt=2**63)]
Samples = Annotated[int, Field(ge=1, le=128)]  # the deployment's cap is the setting max_n
TopLogprobs = Annotated[int, Field(ge=0, le=1024)]  # the deployment's cap is the setting max_logprobs
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's presence / frequency penalty
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]  # transformers' (1 = off)
GENERATION_KEYS = (  # a manifest line's too
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "guided",
)
MAX_GUIDED_JSON_BYTES = 65_536  # a schema, regex or choice list larger than this is refused unread
MAX_GUIDED_CHOICES = 1024


def small_json(value: Any) -> Any:
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_GUIDED_JSON_BYTES:
        raise ValueError(f"{size} bytes of JSON; at most {MAX_GUIDED_JSON_BYTES}")
    return value


class GuidedSpec(Strict):
    """Output constrained token by token (engines/guided.py): exactly one of a JSON schema the
    text validates against, a regular expression it matches whole, or a list of strings it is
    one of. Part of the job's identity (its params)."""

    json_schema: Annotated[dict[str, Any], BeforeValidator(shallow), AfterValidator(small_json)] | None = None
    regex: Annotated[Text, Field(min_length=1, max_length=MAX_GUIDED_JSON_BYTES)] | None = None
    choice: Annotated[tuple[Annotated[Text, Field(min_length=1)], ...], AfterValidator(small_json)] | None = Field(
        None, min_length=1, max_length=MAX_GUIDED_CHOICES
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> GuidedSpec:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex and choice (got {', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None)

    def canonical(self) -> str:
        """Its JSON with sorted keys: equal specs, equal text (the grammar cache's key)."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))


def nonempty_stops(stop: tuple[str, ...]) -> tuple[str, ...]:
    if any(s == "" for s in stop):
        raise ValueError("stop strings must be non-empty")
    return stop


Stops = Annotated[tuple[Text, ...], AfterValidator(nonempty_stops)]


class GenerationParams(Strict):
    """Which keys a request set is kept (`model_fields_set`, and a job's JSON holds only those):
    the worker fills the others from the checkpoint's generation_config.json (`with_defaults`)."""

    max_new_tokens: MaxNewTokens = 64
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stops = ()
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    guided: GuidedSpec | None = None  # the output's grammar: a JSON schema, a regex or a choice
    n: Samples = 1  # samples of the one prompt; sample i > 0 draws with seed `sample_seed(seed, i)`
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: TopLogprobs = 0  # and this many most likely alternatives at each position (needs logprobs)
    # OpenAI's: subtracted from a token's logit, once if it was generated before / per time it was
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # transformers': a token of the prompt or the output has its logit divided by it (multiplied if negative)
    repetition_penalty: RepetitionPenalty = 1.0

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> GenerationParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _guided_ends(self) -> GenerationParams:
        if self.guided is not None and self.ignore_eos:
            raise ValueError("guided: a guided output ends where its grammar does; drop ignore_eos")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def sample(self, index: int) -> GenerationParams:
        """The parameters of sample `index` of `n`: one sequence, its own seed (None stays None:
        an unseeded sample draws a fresh seed in the engine)."""
        seed = None if self.seed is None else sample_seed(self.seed, index)
        return self.model_copy(update={"n": 1, "seed": seed})

    @property
    def unseeded_sampling(self) -> bool:
        return not self.greedy and self.seed is None

    def with_defaults(self, defaults: dict[str, Any]) -> GenerationParams:
        """These parameters, with `defaults` for the keys the request did not set."""
        if not defaults:
            return self
        return GenerationParams.model_validate({**defaults, **self.model_dump(exclude_unset=True)})


@dataclass(frozen=True)
class SamplingLimits:
    """A deployment's caps on what one request may ask of the sampler (the settings max_n and
    max_logprobs), checked where a request enters (gateway, CLI, producer) and again by the
    worker for jobs enqueued some other way."""

    max_n: int = defaults.MAX_N
    max_logprobs: int = defaults.MAX_LOGPROBS

    def check(self, params: GenerationParams) -> None:
        if params.n > self.max_n:
            raise OverLimit("n", f"{params.n} samples in one request; at most {self.max_n} (max_n)")
        if params.top_logprobs > self.max_logprobs:
            limit = self.max_logprobs
            raise OverLimit(
                "top_logprobs", f"{params.top_logprobs} alternatives per token; at most {limit} (max_logprobs)"
            )


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 keeps it (n = 1 and
    the first of n agree), the others get well-mixed seeds of their own."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits


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


class Timings(Strict):
    queued_s: float  # submitted -> taken by a worker
    preprocess_s: float  # image fetch + decode
    engine_s: float  # in the engine (shared batch time)
    total_s: float  # submitted -> result written
    first_token_s: float | None = None  # submitted -> first token generated (None: the engine does not stream)


FinishReason = Literal["stop", "length", "stop_string"]


class TopLogprob(Strict):
    """One candidate token at a position (OpenAI's shape): its text, log-probability and UTF-8
    bytes (a byte-fallback token's one byte; None where the text is not whole characters)."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None = None


class TokenLogprob(TopLogprob):
    """A generated token's log-probability under the distribution it was drawn from (the logits
    after penalties, temperature, top-k and top-p), with the `top_logprobs` most likely tokens."""

    top_logprobs: tuple[TopLogprob, ...] = ()


class Choice(Strict):
    """One of the `n` samples of a request, in index order."""

    index: int
    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


class CaptionResult(Strict):
    job_id: str
    text: str  # the first sample's (the only one unless params.n > 1)
    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int  # every sample's together
    token_ids: tuple[int, ...]
    timings: Timings
    worker: str
    engine: str
    model: str
    logprobs: tuple[TokenLogprob, ...] | None = None  # with params.logprobs: one per token of `token_ids`
    choices: tuple[Choice, ...] = ()  # params.n > 1: every sample, the first one's fields repeated above

    @model_serializer(mode="wrap")
    def _asked_for_only(self, handler: SerializerFunctionWrapHandler):
        """`logprobs` and `choices` are written only when the request asked for them: a result
        without them costs Redis no more bytes. (No return annotation: the JSON schema stays the
        model's own.)"""
        data = handler(self)
        if data.get("logprobs") is None:
            data.pop("logprobs", None)
        if not data.get("choices"):
            data.pop("choices", None)
        return data


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


ResultStatus = Literal["finished", "failed", "canceled", "unfinished", "unknown"]


class ResultLine(Strict):
    """One line of `wicore caption`'s output file and of `wicore result`: every key on every
    line, null where it does not apply."""

    model_config = ConfigDict(title="wicore result line")

    input: str | None = Field(description="The input as given (null when `wicore result` got bare job ids).")
    job_id: str | None = Field(description="null when the input failed before a job was made.")
    status: ResultStatus = Field(
        description="canceled: `wicore cancel` ended it, no result; unfinished: not ended when the wait ran out; "
        "unknown: no such job."
    )
    text: str | None = None
    error: str | None = Field(
        None, description="Why the job has no result, one line; null unless status is failed/canceled/unknown."
    )
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    timings: Timings | None = None
    worker: str | None = None
    engine: str | None = None
    model: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = Field(None, description="With logprobs: one entry per token.")
    choices: tuple[Choice, ...] = Field((), description="With n > 1: every sample (text, finish_reason, ...).")

    @classmethod
    def of_result(cls, result: CaptionResult, input: str | None = None) -> ResultLine:
        fields = result.model_dump(exclude={"token_ids"})
        return cls(input=input, status="finished", **fields)
