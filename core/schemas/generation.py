"""How a job generates: its sampling parameters, a deployment's caps on them, and the seeds of
its samples."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from wicore import defaults
from wicore.errors import OverLimit
from wicore.schemas.base import Strict, Text
from wicore.schemas.guided import GuidedSpec

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
    # The worker publishes the text as it is generated (a token stream per job, `keys.tokens`);
    # unset, a job's JSON and Redis costs are as without it.
    stream: bool = False
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
