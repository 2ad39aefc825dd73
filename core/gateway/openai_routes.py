"""OpenAI-compatible routes: `POST /v1/chat/completions` (non-streaming, answered through the
queue within `request_timeout_s`) and `GET /v1/models`. The official `openai` package works
against them unchanged: `OpenAI(base_url="http://host:8000/v1", api_key=...)`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from wicore import errors
from wicore.gateway.auth import require_key
from wicore.gateway.errors import ApiError
from wicore.gateway.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
    chat_completion,
    chat_submission,
)
from wicore.gateway.submissions import enqueue_one
from wicore.producer import Outcome

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


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> ChatCompletion:
    """One image + chat -> the assistant's reply, through the queue (the same job as POST /v1/jobs)."""
    gateway = request.app.state.gateway
    submission = chat_submission(body, gateway.config.allowed_roots)
    accepted = await run_in_threadpool(enqueue_one, gateway, body.model, submission)
    outcome = await gateway.wait(accepted.job_id, gateway.config.request_timeout_s, request)
    return completion_of(outcome, accepted.model, gateway.config.request_timeout_s)


def completion_of(outcome: Outcome, model: str, timeout_s: float) -> ChatCompletion:
    if outcome.result is not None:
        return chat_completion(outcome.result, model)
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
