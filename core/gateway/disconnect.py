"""A client that hangs up mid-request: its long-poll or chat completion stops waiting, and the
request ends without an error in the log."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request

CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned; no client sees it


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


@contextlib.asynccontextmanager
async def client_gone(request: Request | None) -> AsyncIterator[asyncio.Event]:
    """An event set once `request`'s client disconnects (never, for None). The request's body
    must have been read: the messages left are the disconnect."""
    gone = asyncio.Event()
    watcher = asyncio.ensure_future(_watch(request, gone)) if request is not None else None
    try:
        yield gone
    finally:
        if watcher is not None:
            watcher.cancel()


async def _watch(request: Request, gone: asyncio.Event) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()
