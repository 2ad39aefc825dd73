"""Requests -> jobs in Redis: each request (or batch line) becomes a producer submission, is
prepared alone (so a bad one gets its own error), and the good ones are enqueued together, one
pipeline per model."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wicore.errors import QueueFull, WicoreError
from wicore.gateway.errors import ApiError, describe_validation
from wicore.gateway.images import allowed_path, decode_image, fetched_url
from wicore.gateway.openai_schemas import ChatCompletionRequest, chat_submission
from wicore.gateway.schemas import (
    BatchLine,
    BatchReply,
    JobAccepted,
    JobFields,
    JobImagePart,
    JobMessage,
    JobRequest,
    OpenAIBatchLine,
)
from wicore.producer import Submission
from wicore.producer.submission import Prepared
from wicore.schemas import ChatMessage, ImagePart, TextPart

MAX_BATCH_LINES = 100_000


@dataclass
class Line:
    """One job of a request: what to submit, or why it cannot be."""

    index: int
    custom_id: str | None = None
    model: str | None = None
    submission: Submission | None = None
    error: str | None = None
    prepared: Prepared | None = field(default=None, repr=False)  # from Producer.prepare
    job_id: str | None = None


GatewayImage = bytes | Path | str  # the bytes, a file under the allowed roots, or a URL a worker fetches


def job_submission(job: JobFields, image: GatewayImage | None, roots: tuple[Path, ...] = ()) -> Submission:
    """`image`: the request's own image (None: none given); image parts of `messages` that name
    none take it, in order, once."""
    if job.messages is None:
        images = () if image is None else (image,)
        return Submission(None, job.prompt, None, job.params, job.priority, job.deadline, job.metadata, images=images)
    given: list[GatewayImage] = [] if image is None else [image]
    messages, images = [], []
    for index, message in enumerate(job.messages):
        messages.append(_chat_message(message, index, given, images, roots))
    if given:
        raise ApiError(400, "image: given, but no image part of messages takes it", param="image")
    return Submission(
        None, None, tuple(messages), job.params, job.priority, job.deadline, job.metadata, images=tuple(images)
    )


def _chat_message(message: JobMessage, index: int, given: list, images: list, roots: tuple[Path, ...]) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(role=message.role, content=message.content)
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(message.content):
        if isinstance(part, TextPart):
            parts.append(part)
            continue
        images.append(_part_image(part, f"messages.{index}.content.{j}", given, roots))
        parts.append(ImagePart())
    return ChatMessage(role=message.role, content=parts)


def _part_image(part: JobImagePart, where: str, given: list, roots: tuple[Path, ...]) -> GatewayImage:
    if part.image is not None:
        return decode_image(part.image, f"{where}.image")
    if part.image_path is not None:
        return allowed_path(part.image_path, roots, f"{where}.image_path")
    if part.image_url is not None:
        return fetched_url(part.image_url, f"{where}.image_url")
    if not given:
        raise ApiError(400, f"{where}: the image part names no image (image, image_path or image_url)", param=where)
    return given.pop(0)


def image_of(job: JobRequest, roots: tuple[Path, ...]) -> GatewayImage | None:
    if job.image is not None:
        return decode_image(job.image, "image")
    if job.image_path is not None:
        return allowed_path(job.image_path, roots, "image_path")
    if job.image_url is not None:
        return fetched_url(job.image_url, "image_url")
    return None


def problem(exc: Exception) -> str:
    """One line saying what is wrong with a batch line."""
    if isinstance(exc, ValidationError):
        return describe_validation(exc.errors(), skip_root=False)[0]
    if isinstance(exc, ApiError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


def parse_line(index: int, obj: Any, roots: tuple[Path, ...], openai_shape: bool) -> Line:
    """A JSON-list element (a JobRequest) or a JSONL line (an OpenAI batch line)."""
    line = Line(index)
    try:
        if openai_shape:
            batch_line = OpenAIBatchLine.model_validate(obj)
            line.custom_id = batch_line.custom_id
            obj = batch_line.body
            if batch_line.url == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(obj)
                line.model, line.submission = chat.model, chat_submission(chat, roots)
                return line
        job = JobRequest.model_validate(obj)
        line.model, line.submission = job.model, job_submission(job, image_of(job, roots), roots)
    except (ValidationError, ApiError, WicoreError) as exc:
        line.error = problem(exc)
    return line


def jsonl_objects(raw: bytes) -> list[Any]:
    """Each non-blank line parsed; a line that is not JSON becomes the string describing why."""
    objects: list[Any] = []
    for number, text in enumerate(raw.splitlines(), start=1):
        if not text.strip():
            continue
        try:
            objects.append(json.loads(text))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            objects.append(NotJson(f"line {number} is not valid JSON ({exc})"))
        except RecursionError:
            objects.append(NotJson(f"line {number} is not valid JSON (nested too deeply)"))
    return objects


class NotJson(str):
    """A JSONL line that did not parse: its error, kept in line order."""


def parse_batch(objects: list[Any], roots: tuple[Path, ...], openai_shape: bool) -> list[Line]:
    if not objects:
        raise ApiError(400, "the batch is empty; send a JSON list of jobs or JSONL lines")
    if len(objects) > MAX_BATCH_LINES:
        raise ApiError(400, f"the batch has {len(objects)} lines; send at most {MAX_BATCH_LINES} per request")
    return [
        Line(i, error=str(obj)) if isinstance(obj, NotJson) else parse_line(i, obj, roots, openai_shape)
        for i, obj in enumerate(objects)
    ]


def enqueue_lines(gateway, lines: list[Line]) -> BatchReply:
    """Prepare each line alone, then enqueue the prepared ones, one pipeline per model."""
    by_model: dict[str, list[Line]] = defaultdict(list)
    for line in lines:
        if line.error is None:
            try:
                producer = gateway.producer(line.model)
                line.prepared = producer.prepare(line.submission)
                by_model[producer.model].append(line)
            except (ValidationError, ApiError, WicoreError) as exc:
                line.error = problem(exc)
    for model, good in by_model.items():
        ids = admitted(gateway, gateway.producer(model), [line.prepared for line in good])
        gateway.metrics.submitted.labels(model).inc(len(ids))
        for line, job_id in zip(good, ids):
            line.job_id, line.prepared = job_id, None
    jobs = [BatchLine(index=ln.index, custom_id=ln.custom_id, job_id=ln.job_id, error=ln.error) for ln in lines]
    accepted = sum(1 for j in jobs if j.job_id)
    return BatchReply(jobs=jobs, accepted=accepted, rejected=len(jobs) - accepted)


def admitted(gateway, producer, prepared: list[Prepared]) -> list[str]:
    """`enqueue_prepared`, with a refusal of admission control as a 429 carrying Retry-After
    (counted in `wicore:jobs_refused`)."""
    try:
        return producer.enqueue_prepared(prepared)
    except QueueFull as full:
        gateway.metrics.refused.labels(full.model, full.lane).inc(len(prepared))
        headers = {"Retry-After": str(full.retry_after_s)}
        raise ApiError(429, f"{full}; the queue is past what the workers finish in time", headers=headers) from None


def enqueue_one(gateway, model: str | None, submission: Submission) -> JobAccepted:
    """A single job: its errors are the request's (ApiError, WicoreError, ValidationError)."""
    producer = gateway.producer(model)
    [job_id] = admitted(gateway, producer, [producer.prepare(submission)])
    gateway.metrics.submitted.labels(producer.model).inc()
    return JobAccepted(job_id=job_id, status_url=f"/v1/jobs/{job_id}", model=producer.model)
