"""How `wicore serve` runs uvicorn, with the limits a server facing many clients needs and uvicorn
leaves open: a request's headers must arrive within `header_timeout_s` of the connection (or of the
previous response); a body that stops streaming for `body_timeout_s` ends its connection; past
`max_connections` open connections a new one is answered 429 with Retry-After and closed at once,
so slow or idle clients cannot take every file descriptor. A request whose body has arrived has no
deadline here: long-polls and chat completions wait as long as their own limits say.

uvicorn times out only idle keep-alive connections (`timeout_keep_alive`); the header and body
deadlines live in a subclass of its h11 protocol, the one place that sees a request's bytes arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
from dataclasses import dataclass, replace

from uvicorn.protocols.http.h11_impl import H11Protocol

from wicore.gateway.errors import error_body

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024  # request line and headers (h11's own default, set explicitly)
# Connections the kernel queues before the server accepts them; asyncio also accepts up to this
# many in one go, before any is counted against the cap, so the cap leaves them descriptors.
BACKLOG = 256
RESERVED_FDS = BACKLOG + 128  # and Redis connections, logs, files
ACCEPT_FAILED = "socket.accept() out of system resource"


@dataclass(frozen=True)
class ServerLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 2048


def raw_response(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, the body in the gateway's error shape."""
    body = json.dumps(error_body(status, message)).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", "connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BUSY = raw_response(429, "Too Many Requests", "the gateway has too many open connections; retry shortly",
                    {"retry-after": "1"})  # fmt: skip
HEADERS_LATE = raw_response(408, "Request Timeout", "the request's headers did not arrive in time")


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`' deadlines and connection cap."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.deadline: asyncio.TimerHandle | None = None
            if len(self.connections) > limits.max_connections:
                transport.write(BUSY)
                transport.close()
                return
            self._expect_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
                return  # between requests: the header deadline keeps running
            if self.cycle.more_body:
                self._set_deadline(limits.body_timeout_s, self._body_stalled)
            else:
                self._set_deadline(None, None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._set_deadline(None, None)
            super().connection_lost(exc)

        def _expect_headers(self) -> None:
            self._set_deadline(limits.header_timeout_s, self._headers_late)

        def _set_deadline(self, seconds: float | None, expire) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(seconds, expire) if seconds is not None else None

        def _headers_late(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(HEADERS_LATE)
                self.transport.close()

        def _body_stalled(self) -> None:
            self.transport.close()  # the route reads a disconnect and ends quietly

    return GuardedH11Protocol


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to fit this process's descriptor limit (raised to its hard limit first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < hard:
        soft = hard if hard != resource.RLIM_INFINITY else max(soft, wanted + RESERVED_FDS)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY:
        return wanted
    cap = min(wanted, soft - RESERVED_FDS)
    if cap < 1:
        raise OSError(f"the descriptor limit ({soft}) leaves no room for client connections (ulimit -n)")
    return cap


class QuietAcceptErrors:
    """An event-loop exception handler: asyncio logs a traceback for every accept() that finds no
    descriptor left (up to the backlog, each loop turn); this logs one line a second instead."""

    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self.last = float("-inf")
        self.missed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self.missed += 1
        if loop.time() - self.last >= self.every_s:
            log.warning("no file descriptor left to accept %d connections (%s)", self.missed, context.get("exception"))
            self.last, self.missed = loop.time(), 0


def run(app, host: str, port: int, limits: ServerLimits, log_level: str) -> None:
    import uvicorn

    cap = connection_cap(limits.max_connections)
    if cap < limits.max_connections:
        log.warning("at most %d client connections: the descriptor limit allows no more", cap)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(replace(limits, max_connections=cap)),
        backlog=BACKLOG,
        timeout_keep_alive=math.ceil(limits.keep_alive_s),  # uvicorn takes whole seconds
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = server_class()(config)
    server.run()
    if not server.started:
        raise OSError(f"the gateway could not start on {host}:{port} (its log says why)")


def server_class():
    """uvicorn's Server, with `QuietAcceptErrors` on its event loop."""
    import uvicorn

    class Server(uvicorn.Server):
        async def serve(self, sockets=None) -> None:
            asyncio.get_running_loop().set_exception_handler(QuietAcceptErrors())
            await super().serve(sockets)

    return Server
