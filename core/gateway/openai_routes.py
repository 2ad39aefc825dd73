"""OpenAI-compatible routes: `POST /v1/chat/completions` and `POST /v1/completions` (answered
through the queue within `request_timeout_s`, or streamed as server-sent events with
`stream: true`), `GET /v1/models` and `GET /v1/models/{id}`. The official `openai` package works
against them unchanged: `OpenAI(base_url="http://host:8000/v1", api_key=...)`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from wicore import errors
from wicore.gateway import examples as ex
from wicore.gateway.auth import require_key
from wicore.gateway.errors import ApiError
from wicore.gateway.examples import examples
from wicore.gateway.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    TextCompletion,
    chat_completion,
    chat_submission,
    completion_submission,
    text_completion,
)
from wicore.gateway.openai_streams import STREAM_RESPONSE_DOC, ChunkShape, completion_events, event_stream
from wicore.gateway.submissions import enqueue_one
from wicore.producer import Outcome, Submission
from wicore.schemas import CaptionResult

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["openai"])


def input_error_names() -> tuple[str, ...]:
    """Class names that start the message of a job that failed through its own input."""
    found, todo = [], [errors.JobInputError]
    while todo:
        cls = todo.pop()
        found.append(cls.__name__)
        todo += cls.__subclasses__()
    return (*found, "InvalidJob")


INPUT_ERRORS = input_error_names()
CHAT_BODY = Annotated[
    ChatCompletionRequest, Body(openapi_examples=examples(image_and_prompt=ex.CHAT, streamed=ex.CHAT_STREAM))
]
COMPLETION_BODY = Annotated[
    CompletionRequest,
    Body(openapi_examples=examples(text_prompt=ex.COMPLETION, streamed={**ex.COMPLETION, "stream": True})),
]


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_RESPONSE_DOC)
async def chat_completions(request: Request, body: CHAT_BODY) -> ChatCompletion | StreamingResponse:
    """Images + chat -> the assistant's reply, through the queue (the same job as POST /v1/jobs);
    with `stream: true`, its text as server-sent events while it is generated."""
    gateway = request.app.state.gateway
    submission = chat_submission(body, gateway.config.allowed_roots, streams=True)
    if body.stream:
        return await stream_completion(request, body, submission, "chat", "chatcmpl")
    outcome, model = await answer(request, body.model, submission)
    return chat_completion(result_of(outcome, gateway.config.request_timeout_s), model)


@router.post("/completions", response_model=TextCompletion, responses=STREAM_RESPONSE_DOC)
async def completions(request: Request, body: COMPLETION_BODY) -> TextCompletion | StreamingResponse:
    """A text prompt -> its continuation (OpenAI's legacy completions; one prompt, no images);
    with `stream: true`, as server-sent events."""
    submission = completion_submission(body)
    if body.stream:
        return await stream_completion(request, body, submission, "text", "cmpl")
    outcome, model = await answer(request, body.model, submission)
    return text_completion(result_of(outcome, request.app.state.gateway.config.request_timeout_s), model)


async def answer(request: Request, model: str, submission: Submission) -> tuple[Outcome, str]:
    """Enqueue and wait, within `request_timeout_s`, for the job's end."""
    gateway = request.app.state.gateway
    accepted = await run_in_threadpool(enqueue_one, gateway, model, submission)
    return await gateway.wait(accepted.job_id, gateway.config.request_timeout_s, request), accepted.model


async def stream_completion(
    request: Request, body: ChatCompletionRequest | CompletionRequest, submission: Submission, kind: str, prefix: str
) -> StreamingResponse:
    gateway = request.app.state.gateway
    accepted = await run_in_threadpool(enqueue_one, gateway, body.model, submission)
    first = await run_in_threadpool(gateway.producer().poll, accepted.job_id)
    shape = ChunkShape(kind, prefix, accepted.job_id, accepted.model)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    timeout = gateway.config.request_timeout_s
    events = completion_events(gateway, shape, first, request, include_usage, lambda o: result_of(o, timeout))
    return event_stream(events)


def result_of(outcome: Outcome, timeout_s: float) -> CaptionResult:
    """The job's result, or the error the route answers for how it ended (or did not)."""
    if outcome.result is not None:
        return outcome.result
    job = outcome.job_id
    if outcome.canceled:
        raise ApiError(409, f"job {job} was canceled before it ended")
    if outcome.error is not None and outcome.error.startswith(INPUT_ERRORS):
        raise ApiError(400, f"job {job} failed: {outcome.error}")
    if outcome.error is not None:
        raise ApiError(502, f"job {job} failed in the worker: {outcome.error}")
    raise ApiError(504, f"job {job} is still {outcome.status} after {timeout_s:g}s; GET /v1/jobs/{job} will have it")


@router.get("/models", response_model=ModelList)
def models(request: Request) -> ModelList:
    """The models that live workers serve."""
    served = request.app.state.gateway.live_models()
    return ModelList(data=[ModelCard(id=name) for name in sorted(served)])


@router.get("/models/{model_id}", response_model=ModelCard)
def model(request: Request, model_id: str) -> ModelCard:
    """One model that a live worker serves; 404 for any other."""
    served = request.app.state.gateway.live_models(cached=True)
    if model_id not in served:
        names = ", ".join(sorted(served)) or "none"
        raise ApiError(404, f"model {model_id!r} is not served by any live worker (served: {names})", param="model")
    return ModelCard(id=model_id)
