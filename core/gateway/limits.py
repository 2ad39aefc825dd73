"""Request bodies: a size limit enforced while the body streams in, and the body read as JSON
or as a multipart form with errors that say what to fix."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wicore.gateway.errors import ApiError, error_response

JSON_TYPES = ("application/json",)
JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/json-lines", "text/jsonl")
MULTIPART = "multipart/form-data"


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes the limit, so the route stops reading it. An
    HTTPException: FastAPI's own body parsing (chat completions) passes those on unchanged."""

    def __init__(self) -> None:
        super().__init__(413)


class BodyLimit:
    """ASGI middleware: refuse a declared Content-Length over `max_bytes` at once (413), and stop
    a streamed body the moment it passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            await too_large(self.max_bytes)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge()
            return message

        await self.app(scope, counted, send)


def too_large(max_bytes: int):
    return error_response(
        413,
        f"request body is over the gateway's {max_bytes}-byte limit; send fewer or "
        "smaller images per request, or raise the setting max_request_bytes",
    )


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON (nested too deeply)") from None


async def form_body(request: Request, max_bytes: int) -> FormData:
    try:
        return await request.form(max_files=1, max_fields=32, max_part_size=max_bytes)
    except BodyTooLarge:
        raise
    except Exception as exc:  # python-multipart and Starlette raise several kinds for a bad form
        raise ApiError(400, f"the multipart form cannot be read ({exc})") from None


def json_field(form: FormData, name: str) -> Any:
    """A form field that carries JSON (params, messages, metadata)."""
    raw = form.get(name)
    if raw is None:
        return None
    if isinstance(raw, UploadFile):
        raise ApiError(400, f"{name}: send it as a text field holding JSON, not a file", param=name)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"{name}: not valid JSON ({exc})", param=name) from None
