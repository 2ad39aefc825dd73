"""A batch's lines: an input line (OpenAI's `{custom_id, method, url, body}`) read into a job's
submission or the reason it cannot be one, and the output line (OpenAI's `{id, custom_id,
response: {status_code, request_id, body}, error}`) each line ends as."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wicore.errors import WicoreError
from wicore.gateway.batch_shapes import CHAT_ENDPOINT
from wicore.gateway.errors import ApiError
from wicore.gateway.openai_routes import INPUT_ERRORS
from wicore.gateway.openai_schemas import ChatCompletionRequest, chat_completion, chat_submission
from wicore.gateway.schemas import OpenAIBatchLine
from wicore.gateway.submissions import problem
from wicore.producer import Outcome, Submission
from wicore.schemas import Lane

EXPIRED = ("batch_expired", "This request could not be executed before the completion window expired.")
CANCELLED = ("batch_cancelled", "This request was cancelled before it ran.")


@dataclass
class InputLine:
    number: int  # 1-based, among the file's non-blank lines
    custom_id: str
    model: str | None = None
    submission: Submission | None = None
    error: str | None = None


def read_line(number: int, raw: bytes, roots: tuple[Path, ...]) -> InputLine:
    """One input line as a bulk-lane submission, or what is wrong with it."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return InputLine(number, "", error=f"line {number} is not valid JSON ({exc})")
    line = InputLine(number, custom_id_of(obj))
    if not line.custom_id:
        line.error = "custom_id: each line needs a custom_id (a non-empty string)"
        return line
    try:
        request = OpenAIBatchLine.model_validate(obj)
        if request.url != CHAT_ENDPOINT:
            raise ApiError(400, f"url: {request.url} is not this batch's endpoint {CHAT_ENDPOINT}", param="url")
        chat = ChatCompletionRequest.model_validate(request.body)
        submission = chat_submission(chat, roots)
        line.model, line.submission = chat.model, replace(submission, priority=Lane.LOW)
    except (ValidationError, ApiError, WicoreError) as exc:
        line.error = problem(exc)
    return line


def custom_id_of(obj: Any) -> str:
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else ""


def custom_id_in(raw: bytes) -> str:
    """The custom_id of a line not run (cancelled or expired), '' when it has none."""
    try:
        return custom_id_of(json.loads(raw))
    except (ValueError, RecursionError):
        return ""


def request_id(batch_id: str, number: int) -> str:
    """The output line's id: the same line of the same batch always gets the same one."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:32]


def output_line(batch_id: str, number: int, custom_id: str, response: dict | None, error: dict | None) -> bytes:
    line = {"id": request_id(batch_id, number), "custom_id": custom_id or None, "response": response, "error": error}
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def error_body(status_code: int, message: str, request: str) -> dict:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return {"status_code": status_code, "request_id": request, "body": body}


def refused_line(batch_id: str, line: InputLine) -> bytes:
    """A line that never became a job: answered as the endpoint answers a bad request."""
    return output_line(batch_id, line.number, line.custom_id, error_body(400, line.error or "", ""), None)


def not_run_line(batch_id: str, number: int, custom_id: str, reason: tuple[str, str]) -> bytes:
    code, message = reason
    return output_line(batch_id, number, custom_id, None, {"code": code, "message": message})


def ended_line(
    batch_id: str, number: int, custom_id: str, model: str, outcome: Outcome, canceled_as: tuple[str, str] = CANCELLED
) -> tuple[bool, bytes]:
    """(answered, the line) for a job that ended: 200 and its chat completion, or its error (a
    job the batch canceled: `canceled_as`, why it was)."""
    if outcome.result is not None:
        body = chat_completion(outcome.result, model).model_dump(mode="json")
        response = {"status_code": 200, "request_id": outcome.job_id, "body": body}
        return True, output_line(batch_id, number, custom_id, response, None)
    if outcome.canceled:
        return False, not_run_line(batch_id, number, custom_id, canceled_as)
    error = outcome.error or f"job ended {outcome.status}"
    status_code = 400 if error.startswith(INPUT_ERRORS) else 500
    return False, output_line(batch_id, number, custom_id, error_body(status_code, error, outcome.job_id), None)
