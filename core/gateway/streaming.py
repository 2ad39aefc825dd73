"""A job's text as the worker generates it, for server-sent events.

A job that asked to stream (`GenerationParams.stream`) has a token stream in Redis
(`keys.tokens`): the worker adds at most one entry per engine step, `{at, text}`: `text` goes at
character `at` of the job's text. The gateway's one blocking reader (`ResultReader`) wakes a
follower when the token stream or the job's result stream gets an entry; the follower reads the
new entries with XRANGE and hands out the characters its client has not had. When the job ends,
what the deltas did not carry (all of it, for an engine that streams at the end of its batch)
comes from the job's result: the pieces always add up to the result's text.

Time limits: until the first text arrives the wait is bounded by `request_timeout_s` (a queued
job has no text yet); after it, by `stream_idle_timeout_s` between two pieces, with no ceiling
while text flows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from wicore import keys
from wicore.gateway.disconnect import ClientGone, client_gone
from wicore.gateway.errors import ApiError, error_body
from wicore.gateway.state import WAIT_SLICE_S, Gateway, first_set
from wicore.producer import Outcome
from wicore.producer.waiting import NO_ENTRY

log = logging.getLogger(__name__)

READ_COUNT = 256  # token-stream entries read per XRANGE
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies pass each event on at once
DONE = "data: [DONE]\n\n"


class StreamTimeout(Exception):
    """No text (or no end) came within the stream's time limits."""


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event of `data` as compact JSON."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_error(error: ApiError) -> str:
    """An error after the response started, in OpenAI's shape (the `openai` client raises it)."""
    return sse(error_body(error.status, error.message, error.param))


class TextFollower:
    """What a client has been sent of one job's text, and where it is in the token stream. An
    entry repeating text already sent (a job run again) adds only what is new; one past it (entries
    trimmed by the stream's cap) waits for the result."""

    def __init__(self, job_id: str):
        self.key = keys.tokens(job_id)
        self.cursor = NO_ENTRY
        self.sent = 0

    async def read(self, redis: AsyncRedis) -> list[str]:
        """The new characters of each entry added since the last read (a reader that comes
        late gets the pieces as they were generated)."""
        pieces: list[str] = []
        while True:
            start = "-" if self.cursor == NO_ENTRY else f"({self.cursor}"
            entries: list = await redis.xrange(self.key, min=start, count=READ_COUNT) or []
            pieces += filter(None, (self._take(entry_id, fields) for entry_id, fields in entries))
            if len(entries) < READ_COUNT:
                return pieces

    def rest(self, text: str) -> str:
        """The end of the job's whole text that the deltas did not carry."""
        rest = text[self.sent :]
        self.sent = len(text)
        return rest

    def _take(self, entry_id: bytes | str, fields: dict) -> str:
        self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        at, text = parse_delta(fields)
        if at is None or at > self.sent:
            return ""
        new = text[self.sent - at :]
        self.sent += len(new)
        return new


def parse_delta(fields: dict) -> tuple[int | None, str]:
    """(at, text) of a token-stream entry; (None, "") for one that is not shaped as the worker
    writes them (nothing read from Redis is trusted)."""
    raw_at, raw_text = fields.get(b"at", fields.get("at")), fields.get(b"text", fields.get("text"))
    try:
        at = int(raw_at) if raw_at is not None else None
    except ValueError:
        return None, ""
    if at is None or at < 0 or raw_text is None:
        return None, ""
    text = raw_text.decode("utf-8", "replace") if isinstance(raw_text, bytes) else str(raw_text)
    return at, text


class Limits:
    """The stream's deadline: `first_s` for the first text, then `idle_s` after each piece."""

    def __init__(self, first_s: float, idle_s: float):
        self.idle_s = idle_s
        self.waited = f"its first text within {first_s:g}s (request_timeout_s)"
        self.deadline = time.monotonic() + first_s

    def flowed(self) -> None:
        self.waited = f"more text within {self.idle_s:g}s (stream_idle_timeout_s)"
        self.deadline = time.monotonic() + self.idle_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


async def job_text(
    gateway: Gateway, job_id: str, first: tuple[Outcome, str], request: Request | None
) -> AsyncIterator[str | Outcome]:
    """The job's text in pieces as they arrive, then its `Outcome`. `first`: `Producer.poll`'s
    answer read before the response started. Raises `ClientGone` as soon as the client hangs
    up, `StreamTimeout` past the limits (module docstring)."""
    outcome, last_seen = first
    follower = TextFollower(job_id)
    limits = Limits(gateway.config.request_timeout_s, gateway.config.stream_idle_timeout_s)
    results = gateway.reader_for(job_id)
    async with (
        results.watching(job_id, last_seen) as ended,
        results.watching_stream(follower.key, NO_ENTRY) as arrived,
        client_gone(request) as gone,
    ):
        while True:
            if pieces := await follower.read(gateway.quick_for(job_id)):
                limits.flowed()
                for piece in pieces:
                    yield piece
            if outcome.done:
                break
            outcome = await _next_wake(gateway, job_id, outcome, (ended, arrived, gone), limits)
    if outcome.result is not None and (rest := follower.rest(outcome.result.text)):
        yield rest
    yield outcome


async def _next_wake(
    gateway: Gateway, job_id: str, outcome: Outcome, events: tuple[asyncio.Event, ...], limits: Limits
) -> Outcome:
    """Wait for text, the job's end or a slice of time; the job read again unless text woke us."""
    ended, arrived, gone = events
    left = limits.left()
    if left <= 0:
        raise StreamTimeout(f"job {job_id} did not send {limits.waited}")
    await first_set(events, min(left, WAIT_SLICE_S))
    if gone.is_set():
        raise ClientGone()
    if arrived.is_set() and not ended.is_set():
        arrived.clear()
        return outcome
    arrived.clear()
    ended.clear()
    outcome, _ = await run_in_threadpool(gateway.producer().poll, job_id)
    return outcome


def cancel_later(gateway: Gateway, job_id: str) -> None:
    """Cancel the job from a thread, not awaited: this runs where the stream's generator is being
    closed (its client gone), which may not await any more."""
    canceling = asyncio.get_running_loop().run_in_executor(None, gateway.producer().cancel, [job_id])
    canceling.add_done_callback(lambda done: _log_failed_cancel(job_id, done))


def _log_failed_cancel(job_id: str, done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("canceling job %s after its client left failed: %s", job_id, done.exception())
