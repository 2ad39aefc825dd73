"""What a job gives back: its text, tokens, log-probabilities and timings, and the line a
result is written as (`wicore caption`'s output, `wicore result`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from wicore.schemas.base import Strict


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
