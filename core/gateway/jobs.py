"""The native job routes: submit one job (JSON or multipart) or a batch, read a job (long-poll
with `?wait=`), cancel it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.responses import StreamingResponse

from wicore.gateway import examples as ex
from wicore.gateway.auth import require_key
from wicore.gateway.disconnect import ClientGone
from wicore.gateway.errors import ApiError, error_body
from wicore.gateway.examples import examples
from wicore.gateway.limits import JSON_TYPES, JSONL_TYPES, MULTIPART, form_body, json_body, json_field, media_type
from wicore.gateway.openai_streams import event_stream
from wicore.gateway.schemas import BatchReply, CancelReply, JobAccepted, JobFields, JobRequest, JobView
from wicore.gateway.streaming import StreamTimeout, job_text, sse
from wicore.gateway.submissions import (
    enqueue_lines,
    enqueue_one,
    image_of,
    job_submission,
    jsonl_objects,
    parse_batch,
)
from wicore.producer import Outcome
from wicore.producer.waiting import MISSING, no_such_job

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["jobs"])

MAX_WAIT_S = 600.0
JOB_ID = Path(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="The id POST /v1/jobs returned.")
JSON_FIELDS = ("params", "messages", "metadata")  # multipart text fields that hold JSON


def body_doc(*types: tuple[str, dict]) -> dict:
    """OpenAPI requestBody for a route that reads its body by Content-Type."""
    return {"requestBody": {"required": True, "content": dict(types)}}


MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["image"],
    "properties": {
        "image": {"type": "string", "format": "binary", "description": "The image file."},
        "prompt": {"type": "string"},
        "model": {"type": "string"},
        "priority": {"type": "string", "enum": ["high", "normal", "low"]},
        "deadline": {"type": "number", "description": "Unix seconds."},
        **{name: {"type": "string", "description": "JSON, as in the JSON body."} for name in JSON_FIELDS},
    },
}
JOB_BODY = body_doc(
    (
        "application/json",
        {
            "schema": {"$ref": "#/components/schemas/JobRequest"},
            "examples": examples(image_and_prompt=ex.JOB, streamed=ex.JOB_STREAM),
        },
    ),
    (MULTIPART, {"schema": MULTIPART_SCHEMA}),
)
BATCH_BODY = body_doc(
    (
        "application/json",
        {
            "schema": {"type": "array", "items": {"$ref": "#/components/schemas/JobRequest"}},
            "examples": examples(two_jobs=ex.JOB_BATCH),
        },
    ),
    (
        "application/jsonl",
        {
            "schema": {"$ref": "#/components/schemas/OpenAIBatchLine"},
            "examples": examples(openai_batch_lines=ex.jsonl(ex.BATCH_LINE)),
        },
    ),
)


@router.post("/jobs", status_code=202, response_model=JobAccepted, openapi_extra=JOB_BODY)
async def submit_job(request: Request) -> JobAccepted:
    """Submit one job. Same work (image, conversation, parameters, model) = same id, run once."""
    gateway = request.app.state.gateway
    kind = media_type(request)
    if kind == MULTIPART:
        fields, upload = await multipart_job(request)
        submission = job_submission(fields, upload, gateway.config.allowed_roots)
    elif kind in JSON_TYPES or not kind:
        fields = JobRequest.model_validate(await json_body(request))
        roots = gateway.config.allowed_roots
        submission = job_submission(fields, image_of(fields, roots), roots)
    else:
        raise ApiError(415, f"Content-Type {kind} is not accepted: send application/json or multipart/form-data")
    return await run_in_threadpool(enqueue_one, gateway, fields.model, submission)


async def multipart_job(request: Request) -> tuple[JobFields, bytes]:
    form = await form_body(request, request.app.state.gateway.config.max_request_bytes)
    upload = form.get("image")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "image: attach the image as a file part (curl -F image=@photo.png)", param="image")
    data = {key: value for key, value in form.items() if key != "image"}
    data.update({name: json_field(form, name) for name in JSON_FIELDS if name in form})
    fields, image = JobFields.model_validate(data), await upload.read()
    if not image:
        raise ApiError(400, "image: the uploaded file is empty", param="image")
    return fields, image


@router.post("/jobs/batch", status_code=202, response_model=BatchReply, openapi_extra=BATCH_BODY)
async def submit_batch(request: Request) -> BatchReply:
    """Many jobs in one request, pipelined into Redis: a JSON list of jobs, or JSONL lines shaped
    as OpenAI's batch input file. One id, or one error, per line, in order."""
    gateway = request.app.state.gateway
    kind = media_type(request)
    if kind in JSONL_TYPES:
        lines = parse_batch(jsonl_objects(await request.body()), gateway.config.allowed_roots, openai_shape=True)
    elif kind in JSON_TYPES or not kind:
        body = await json_body(request)
        if not isinstance(body, list):
            raise ApiError(
                400, "a JSON batch is a list of jobs; for OpenAI batch lines send Content-Type application/jsonl"
            )
        lines = parse_batch(body, gateway.config.allowed_roots, openai_shape=False)
    else:
        raise ApiError(415, f"Content-Type {kind} is not accepted: send application/json or application/jsonl")
    return await run_in_threadpool(enqueue_lines, gateway, lines)


@router.get("/jobs/{job_id}", response_model=JobView)
async def get_job(
    request: Request,
    job_id: str = JOB_ID,
    wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="Seconds to wait for the job to end."),
) -> JobView:
    """The job's status and result; with `wait`, the answer comes when it ends (or at `wait`)."""
    outcome = await request.app.state.gateway.wait(job_id, wait, request)
    return job_view(outcome)


def job_view(outcome: Outcome) -> JobView:
    return JobView(job_id=outcome.job_id, status=outcome.status, result=outcome.result, error=outcome.error)


STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": 'Server-sent events: `event: text` (data `{"text"}`) as the text is generated, '
        "then `event: end` (data: the job, as GET /v1/jobs/{id} answers it)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@router.get("/jobs/{job_id}/stream", response_class=StreamingResponse, responses=STREAM_DOC)
async def stream_job(request: Request, job_id: str = JOB_ID) -> StreamingResponse:
    """The job's text while it is generated, as server-sent events (a job submitted with
    `params.stream: true` streams step by step; any other sends its text in one event as it
    ends), then its end. Hanging up does not cancel the job."""
    gateway = request.app.state.gateway
    first = await run_in_threadpool(gateway.producer().poll, job_id)
    return event_stream(job_events(gateway, first, request))


async def job_events(gateway, first: tuple[Outcome, str], request: Request) -> AsyncIterator[str]:
    try:
        async for piece in job_text(gateway, first[0].job_id, first, request):
            if isinstance(piece, str):
                yield sse({"text": piece}, "text")
            else:
                yield sse(job_view(piece).model_dump(mode="json"), "end")
    except StreamTimeout as timeout:
        yield sse(error_body(504, str(timeout)), "error")
    except RedisError as error:
        yield sse(error_body(503, f"Redis is unavailable ({type(error).__name__}); retry shortly"), "error")
    except ClientGone:
        pass


@router.delete("/jobs/{job_id}", response_model=CancelReply)
def cancel_job(request: Request, job_id: str = JOB_ID) -> CancelReply:
    """Cancel: a queued job never runs; a running one stops at the engine's next step."""
    status = request.app.state.gateway.producer().cancel([job_id])[job_id]
    if status == MISSING:
        raise no_such_job(job_id)
    return CancelReply(job_id=job_id, status=status)
