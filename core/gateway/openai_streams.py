"""OpenAI's streamed answers (`stream: true`) as server-sent events: a chat completion's chunks
(the first with the role, then content deltas, the last with `finish_reason`), or a text
completion's. A chat that asked for `logprobs` gets every token's in its last chunk: the worker
streams text, and the tokens are known once the job's result is. With `stream_options.include_usage` a last chunk of no choices carries the usage;
then `data: [DONE]`. An error after the stream started is an event in OpenAI's error shape.

A client that hangs up before the end cancels its job (`stream_cancel_on_disconnect`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from wicore.gateway.disconnect import ClientGone
from wicore.gateway.errors import ApiError
from wicore.gateway.openai_schemas import ChoiceLogprobs, usage
from wicore.gateway.state import Gateway
from wicore.gateway.streaming import DONE, SSE_HEADERS, StreamTimeout, cancel_later, job_text, sse, sse_error
from wicore.producer import Outcome
from wicore.schemas import CaptionResult

EVENT_STREAM = "text/event-stream"


class ChunkShape:
    """How one kind of completion's chunks look: chat (`delta`) or text (`text`)."""

    def __init__(self, kind: str, id_prefix: str, job_id: str, model: str):
        self.kind, self.model = kind, model
        self.id = f"{id_prefix}-{job_id}"
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }

    def choice(
        self, text: str | None, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.kind == "chat":
            body["delta"] = {} if text is None else {"content": text}
        else:
            body["text"] = text or ""
        return body

    def opening(self) -> dict[str, Any] | None:
        """The chat's first chunk names the role; a text completion has none."""
        if self.kind != "chat":
            return None
        return self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])  # fmt: skip


async def completion_events(
    gateway: Gateway,
    shape: ChunkShape,
    first: tuple[Outcome, str],
    request: Request,
    include_usage: bool,
    check: Callable[[Outcome], CaptionResult],
) -> AsyncIterator[str]:
    """The events of one streamed completion. `check` turns the job's end into its result, or
    raises the `ApiError` the non-streamed route would answer."""
    job_id = first[0].job_id
    ended = False
    try:
        if (opening := shape.opening()) is not None:
            yield sse(opening)
        async for piece in job_text(gateway, job_id, first, request):
            if isinstance(piece, str):
                yield sse(shape.chunk([shape.choice(piece)]))
                continue
            ended = True
            result = check(piece)
            reason = "length" if result.finish_reason == "length" else "stop"
            yield sse(shape.chunk([shape.choice(None, reason, token_logprobs(result))]))
            if include_usage:
                yield sse(shape.chunk([], usage(result).model_dump()))
        yield DONE
    except ApiError as error:
        yield sse_error(error)
    except StreamTimeout as timeout:
        ended = True  # the job goes on; GET /v1/jobs/{id} will have it
        yield sse_error(ApiError(504, f"{timeout}; GET /v1/jobs/{job_id} will have it"))
    except ClientGone:
        pass
    except RedisError as error:  # the headers are out: the client reads the failure as an event
        yield sse_error(ApiError(503, f"Redis is unavailable ({type(error).__name__}); retry shortly"))
    finally:
        if not ended and gateway.config.stream_cancel_on_disconnect:
            cancel_later(gateway, job_id)


def token_logprobs(result: CaptionResult) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a chat choice, `{"content": [...]}`, when the request asked for them."""
    if result.logprobs is None:
        return None
    return ChoiceLogprobs(content=list(result.logprobs)).model_dump(mode="json")


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type=EVENT_STREAM, headers=SSE_HEADERS)


STREAM_RESPONSE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "With `stream: true`: server-sent events, each `data: {chunk}`, then `data: [DONE]`",
        "content": {EVENT_STREAM: {"schema": {"type": "string"}}},
    }
}
