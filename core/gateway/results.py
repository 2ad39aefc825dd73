"""The gateway's one reader of RQ result streams (and of streaming jobs' token streams). Every
request waiting for a job (a long-poll, a chat completion) registers the job's result stream here and awaits an asyncio event; a single
task reads all registered streams with one blocking XREAD on its own connection and sets the
events of the streams that got an entry. However many requests wait, they hold no pooled Redis
connection and no thread.

A registration while the XREAD blocks ends that read at once with CLIENT UNBLOCK (sent on the
pooled client: a quick command), so the next read includes the new stream. Where the server
refuses CLIENT UNBLOCK (an ACL without it), reads block in short slices instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError, ResponseError

from wicore.producer.rq_records import result_stream

log = logging.getLogger(__name__)

READ_SLICE_MS = 2_000  # a read with nothing new ends this often (then the registrations are read anew)
SHORT_SLICE_MS = 50  # the read's length where CLIENT UNBLOCK is refused
UNBLOCK_RETRY_S = 0.005  # an unblock sent before the read reached the server is sent again
RETRY_AFTER_ERROR_S = 0.5


@dataclass
class Watch:
    """One stream's waiters: the id of the newest entry they have seen, and their wake-up."""

    last_seen: str
    event: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0


class ResultReader:
    def __init__(self, reader: AsyncRedis, control: AsyncRedis):
        self.reader = reader  # one connection, blocked in XREAD most of the time
        self.control = control  # the pooled client: CLIENT UNBLOCK
        self.watches: dict[str, Watch] = {}
        self.changed = asyncio.Event()
        self.can_unblock = True
        self._reader_id: int | None = None
        self._task: asyncio.Task | None = None

    def watching(self, job_id: str, last_seen: str) -> contextlib.AbstractAsyncContextManager[asyncio.Event]:
        """An event set when the job's result stream gets an entry after `last_seen`; the
        waiter clears it before it reads the job again."""
        return self.watching_stream(result_stream(job_id), last_seen)

    @contextlib.asynccontextmanager
    async def watching_stream(self, stream: str, last_seen: str) -> AsyncIterator[asyncio.Event]:
        """An event set when `stream` (a result stream, a job's token stream) gets an entry
        after `last_seen`."""
        watch = self.watches.setdefault(stream, Watch(last_seen))
        watch.waiters += 1
        self._start()
        self.changed.set()
        try:
            yield watch.event
        finally:
            watch.waiters -= 1
            if watch.waiters == 0 and self.watches.get(stream) is watch:
                del self.watches[stream]

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="wicore-result-reader")

    async def _run(self) -> None:
        while True:
            if not self.watches:
                self.changed.clear()
                await self.changed.wait()
                continue
            try:
                await self._read_once()
            except RedisError as exc:  # Redis away: the waiters' own reads of their jobs say so
                log.warning("reading result streams failed: %s", exc)
                self._reader_id = None
                await asyncio.sleep(RETRY_AFTER_ERROR_S)

    async def _read_once(self) -> None:
        if self.can_unblock and self._reader_id is None:
            self._reader_id = await self._client_id()
        self.changed.clear()
        streams: dict = {name: watch.last_seen for name, watch in self.watches.items()}
        block_ms = READ_SLICE_MS if self.can_unblock else SHORT_SLICE_MS
        read = asyncio.ensure_future(self.reader.xread(streams, block=block_ms))
        if self.can_unblock:
            await self._unblock_on_change(read)
        self._deliver(await read)

    async def _client_id(self) -> int | None:
        """The reader connection's id, which CLIENT UNBLOCK names; None where CLIENT is refused."""
        try:
            return await self.reader.client_id()
        except ResponseError as exc:
            self._refused(exc)
            return None

    def _refused(self, exc: ResponseError) -> None:
        log.warning("CLIENT refused (%s): result streams are read in short slices", exc)
        self.can_unblock = False

    async def _unblock_on_change(self, read: asyncio.Future) -> None:
        """Once the registrations change, end the blocked read so that it starts again over them."""
        changed = asyncio.ensure_future(self.changed.wait())
        await asyncio.wait({read, changed}, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
        reader_id = self._reader_id
        while reader_id is not None and not read.done():
            try:
                await self.control.client_unblock(reader_id)
            except ResponseError as exc:
                self._refused(exc)
                return
            await asyncio.wait({read}, timeout=UNBLOCK_RETRY_S)

    def _deliver(self, replies) -> None:
        """XREAD's reply, [[stream, [(id, fields), ...]], ...] (a dict under RESP3)."""
        for stream, entries in replies.items() if isinstance(replies, dict) else replies or ():
            name = stream.decode() if isinstance(stream, bytes) else stream
            watch = self.watches.get(name)
            if watch is not None and entries:
                newest = entries[-1][0]
                watch.last_seen = newest.decode() if isinstance(newest, bytes) else newest
                watch.event.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.reader.aclose()
