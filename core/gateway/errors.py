"""Every error the gateway answers, in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`, which the official clients parse), with a message that says what to fix.

A bad request is a 4xx, never a 500: FastAPI's validation errors, our own `ApiError`s, the
producer's input errors (a bad image, a job pydantic rejects) and Starlette's 404/405 all end
here. A 5xx means the service itself failed: Redis unreachable, or refusing writes (out of
memory, a read-only replica, a failed snapshot), is a 503 with `Retry-After`. A gateway with more
waiting requests than Redis connections answers 429 with `Retry-After`, never a 503.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from wicore.errors import FileStoreUnavailable, ImageTooLarge, JobInputError, UnknownJob, WicoreError
from wicore.gateway.disconnect import CLIENT_CLOSED, ClientGone

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
RETRY_DOWN = {"Retry-After": "5"}  # Redis unreachable: a restart takes seconds
RETRY_REFUSED = {"Retry-After": "2"}  # Redis refuses writes: memory frees as workers take jobs
RETRY_BUSY = {"Retry-After": "1"}  # every connection to Redis is taken: requests end in milliseconds
# The error codes Redis answers a write it refuses with; inside a Lua script the code is part of
# the message (`... -OOM command not allowed ...` on Redis 6).
REFUSAL_CODES = ("OOM", "READONLY", "MISCONF", "NOREPLICAS")


def refusal_code(exc: ResponseError) -> str | None:
    """OOM, READONLY, MISCONF or NOREPLICAS when Redis refused a write for its state (memory,
    replica role, persistence) rather than for the command; else None."""
    if isinstance(exc, OutOfMemoryError):
        return "OOM"
    if isinstance(exc, ReadOnlyError):
        return "READONLY"
    text = str(exc)
    return next((code for code in REFUSAL_CODES if text.startswith(code) or f"-{code} " in text), None)


def refused_message(code: str, exc: ResponseError) -> str:
    text = str(exc)
    return f"Redis refuses writes ({text if text.startswith(code) else f'{code} {text}'})"


class ApiError(Exception):
    """An answer other than success, raised anywhere under a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


class ErrorDetail(BaseModel):
    message: str  # what is wrong and what to send instead
    type: str  # OpenAI's error type: invalid_request_error, authentication_error, ...
    param: str | None = None  # the field at fault, when there is one
    code: int  # the HTTP status


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=status)).model_dump()


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def describe_validation(errors: list[dict[str, Any]], skip_root: bool = True) -> tuple[str, str | None]:
    """Pydantic errors -> ('messages.0.role: Input should be 'user', ...; ...', first field)."""
    parts, first = [], None
    for error in errors[:5]:
        loc = [str(p) for p in error.get("loc", ())]
        if skip_root and len(loc) > 1 and loc[0] in ("body", "query", "path"):
            loc = loc[1:] if error.get("type") != "json_invalid" else []  # its loc is a character position
        field = ".".join(loc)
        first = first or field or None
        parts.append(f"{field}: {error_text(error)}" if field else f"request body: {error_text(error)}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more, first


def error_text(error: dict[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        return f"not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})"
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


def wicore_error_status(exc: WicoreError) -> int:
    if isinstance(exc, ImageTooLarge):
        return 413
    if isinstance(exc, UnknownJob):
        return 404
    return 400 if isinstance(exc, JobInputError) else 500


def http_message(request: Request, exc: HTTPException) -> str:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return f"no route {where}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {request.url.path} (allowed: {allowed or 'none'})"
    return f"{where}: {exc.detail}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(ValidationError)
    async def model_invalid(request: Request, exc: ValidationError) -> JSONResponse:
        message, param = describe_validation(exc.errors(), skip_root=False)
        return error_response(400, message, param)

    @app.exception_handler(WicoreError)
    async def wicore_error(request: Request, exc: WicoreError) -> JSONResponse:
        if isinstance(exc, FileStoreUnavailable):  # its details (endpoint, keys) go to the log only
            log.warning("%s", exc)
            return error_response(503, "the file store is unavailable; retry shortly", headers=RETRY_DOWN)
        return error_response(wicore_error_status(exc), str(exc), getattr(exc, "param", None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, http_message(request, exc), headers=getattr(exc, "headers", None))

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, MaxConnectionsError):
            return error_response(
                429, "the gateway is at its Redis connection limit; retry shortly", headers=RETRY_BUSY
            )
        log.warning("Redis unavailable: %s", exc)
        return error_response(503, "Redis is unavailable; retry shortly", headers=RETRY_DOWN)

    @app.exception_handler(ResponseError)
    async def redis_refused(request: Request, exc: ResponseError) -> JSONResponse:
        if code := refusal_code(exc):
            log.warning("%s", refused_message(code, exc))
            return error_response(503, f"{refused_message(code, exc)}; retry shortly", headers=RETRY_REFUSED)
        log.error("Redis refused a command", exc_info=exc)
        return error_response(500, f"Redis refused a command: {exc}")

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: Exception) -> JSONResponse:
        return error_response(CLIENT_CLOSED, "the client closed the request")
