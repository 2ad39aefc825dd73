"""Where the bytes of uploaded files and batch results live: a folder, an S3-compatible bucket,
or Redis for small files. All are read and written in pieces (append, read in chunks, lines from
an offset), so no file is ever held whole in a gateway's memory; their metadata lives in Redis
(`batch_state`).

In a bucket a file is a run of immutable objects, one per append, each named by the offset it
starts at (`<prefix>/<file id>/<offset, 16 digits>`): an append is one PUT, durable as soon as it
returns, and a cut back to a committed size deletes the objects past it. S3 credentials come from
the standard AWS chain; the endpoint of an S3-compatible store from `s3_endpoint_url`."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from redis import Redis

from wicore import keys
from wicore.errors import ConfigError, FileStoreUnavailable

CHUNK = 1 << 16  # bytes per read
S3_BLOCK = 1 << 20  # bytes one ranged GET of an object fetches
S3_ATTEMPTS = 2  # tries of one S3 call (botocore's; s3fs's own retries off) before the store is unavailable
KNOWN_ENDS = 4096  # files whose size an S3 store remembers from its own appends
OFFSET_DIGITS = 16  # an object's name: the offset it starts at, zero-padded so names sort by it


@dataclass(frozen=True)
class FilesConfig:
    store: Literal["folder", "redis", "s3"] = "folder"
    folder: Path = Path("wicore-files")
    s3_url: str = ""  # the s3 store's s3://bucket/prefix
    s3_endpoint: str | None = None  # an S3-compatible endpoint; None: AWS
    s3_timeout_s: float = 10.0  # connecting to the endpoint, and each read of an answer
    max_bytes: int = 64 * 2**20  # largest upload the store takes (the Redis store: keep it small)


class FileStore(Protocol):
    max_bytes: int
    name: str  # where the bytes are: gateways on one Redis drive only the batches of stores they share

    def append(self, file_id: str, data: bytes) -> int:
        """Add `data` at the end; the file's size afterwards."""
        ...

    def size(self, file_id: str) -> int: ...

    def truncate(self, file_id: str, size: int) -> None: ...

    def chunks(self, file_id: str, start: int = 0) -> Iterator[bytes]:
        """The bytes from `start` on, in pieces."""
        ...

    def delete(self, file_id: str) -> None: ...


class FolderStore:
    """One file per id in `folder`."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.name = f"folder:{folder.resolve()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"files_dir {folder}: cannot be created ({exc.strerror or exc})") from exc

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def append(self, file_id: str, data: bytes) -> int:
        with open(self.path(file_id), "ab") as file:
            file.write(data)
            return file.tell()

    def size(self, file_id: str) -> int:
        try:
            return self.path(file_id).stat().st_size
        except FileNotFoundError:
            return 0

    def truncate(self, file_id: str, size: int) -> None:
        if self.size(file_id) > size:
            os.truncate(self.path(file_id), size)

    def chunks(self, file_id: str, start: int = 0) -> Iterator[bytes]:
        try:
            file = open(self.path(file_id), "rb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError:
            return
        with file:
            file.seek(start)
            while piece := file.read(CHUNK):
                yield piece

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class RedisStore:
    """One Redis string per id (APPEND, GETRANGE): for small files."""

    def __init__(self, connection: Redis, max_bytes: int):
        self.connection, self.max_bytes = connection, max_bytes
        self.name = "redis"

    def append(self, file_id: str, data: bytes) -> int:
        return int(self.connection.append(keys.file_data(file_id), data))

    def size(self, file_id: str) -> int:
        return int(self.connection.strlen(keys.file_data(file_id)))

    def truncate(self, file_id: str, size: int) -> None:
        key = keys.file_data(file_id)
        if self.size(file_id) > size:
            kept = self.connection.getrange(key, 0, size - 1) if size else b""
            self.connection.set(key, kept)

    def chunks(self, file_id: str, start: int = 0) -> Iterator[bytes]:
        while piece := as_bytes(self.connection.getrange(keys.file_data(file_id), start, start + CHUNK - 1)):
            yield piece
            start += len(piece)

    def delete(self, file_id: str) -> None:
        self.connection.delete(keys.file_data(file_id))


class S3Store:
    """One object per append under `s3://bucket/prefix/<file id>/` (see the module's docstring).
    An S3 call that fails (the endpoint down, access refused) raises FileStoreUnavailable."""

    def __init__(self, url: str, endpoint: str | None, max_bytes: int, timeout_s: float = 10.0):
        self.bucket, self.prefix = bucket_and_prefix(url)
        self.max_bytes = max_bytes
        self.fs = s3_filesystem(endpoint, timeout_s)
        self.name = f"s3:{shown(endpoint)}/{self.bucket}/{self.prefix}"
        self.ends: OrderedDict[str, int] = OrderedDict()  # sizes this process wrote last, newest last
        self.client: object = None  # the S3 client last seen without the 100-continue wait
        self.check_bucket(url, endpoint)

    def check_bucket(self, url: str, endpoint: str | None) -> None:
        where = f"files_s3_url {url} at {shown(endpoint)}"
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError as exc:
            raise ConfigError(f"{where}: no bucket {self.bucket!r}; create it or name another") from exc
        except s3_errors() as exc:
            raise ConfigError(f"{where}: cannot reach the bucket ({describe(exc)})") from exc

    def append(self, file_id: str, data: bytes) -> int:
        """One object at the file's end. The size is the one this process last wrote, else listed:
        a file has one writer at a time (an upload, a batch's lease holder), and each holder starts
        with `truncate`, which lists."""
        size = self.ends.pop(file_id, None)
        if size is None:
            size = self.size(file_id)
        if data:
            self.call(self.fs.pipe_file, self.path(file_id, size), data)
        self.remember(file_id, size + len(data))
        return size + len(data)

    def remember(self, file_id: str, size: int) -> None:
        self.ends[file_id] = size
        while len(self.ends) > KNOWN_ENDS:
            self.ends.popitem(last=False)

    def size(self, file_id: str) -> int:
        return sum(length for _, length in self.segments(file_id))

    def truncate(self, file_id: str, size: int) -> None:
        self.ends.pop(file_id, None)
        for start, length in self.segments(file_id):
            if start >= size:
                self.call(self.fs.rm_file, self.path(file_id, start))
            elif start + length > size:  # an object across the cut keeps its head
                head = self.call(self.fs.cat_file, self.path(file_id, start), start=0, end=size - start)
                self.call(self.fs.pipe_file, self.path(file_id, start), head)

    def chunks(self, file_id: str, start: int = 0) -> Iterator[bytes]:
        for begin, length in self.segments(file_id):
            if begin + length > start:
                yield from self.object_chunks(self.path(file_id, begin), max(0, start - begin), length)

    def object_chunks(self, path: str, start: int, length: int) -> Iterator[bytes]:
        """The object's bytes from `start`, one ranged GET per S3_BLOCK."""
        for begin in range(start, length, S3_BLOCK):
            block = self.call(self.fs.cat_file, path, start=begin, end=min(begin + S3_BLOCK, length))
            for at in range(0, len(block), CHUNK):
                yield block[at : at + CHUNK]

    def delete(self, file_id: str) -> None:
        self.ends.pop(file_id, None)
        paths = [self.path(file_id, start) for start, _ in self.segments(file_id)]
        if paths:
            self.call(self.fs.rm, paths)

    def segments(self, file_id: str) -> list[tuple[int, int]]:
        """(offset, size) of the file's objects, in order; [] for a file with none."""
        folder = f"{self.prefix}{file_id}/"
        found = []
        for page in self.pages(folder):
            for item in page.get("Contents", []):
                offset = item["Key"].removeprefix(folder)
                if len(offset) == OFFSET_DIGITS and offset.isdigit():
                    found.append((int(offset), int(item["Size"])))
        return sorted(found)

    def pages(self, folder: str) -> Iterator[dict]:
        token: dict[str, str] = {}
        while True:
            page = self.call(self.fs.call_s3, "list_objects_v2", Bucket=self.bucket, Prefix=folder, **token)
            yield page
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def without_continue_wait(self) -> None:
        """botocore asks S3 for a `100 Continue` before a PUT's body, and aiohttp waits for it
        with no timeout: a PUT to an endpoint that hangs would never end. S3 takes the body
        without it. s3fs makes a new client when its connections closed: each is seen to."""
        from botocore.handlers import add_expect_header

        client = self.fs.connect()
        if client is not self.client:
            client.meta.events.unregister("before-call.s3", add_expect_header)
            self.client = client

    def path(self, file_id: str, offset: int) -> str:
        return f"{self.bucket}/{self.prefix}{file_id}/{offset:0{OFFSET_DIGITS}d}"

    def call(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            self.without_continue_wait()
            return function(*args, **kwargs)
        except s3_errors() as exc:
            raise FileStoreUnavailable(f"the file store s3://{self.bucket}/{self.prefix}: {describe(exc)}") from exc


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """("bucket", "prefix/") of s3://bucket/prefix ("" for no prefix)."""
    if not url:
        raise ConfigError("files_store s3 needs files_s3_url: the s3://bucket/prefix files live under")
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"files_s3_url: {url!r} is not an s3://bucket/prefix URL")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def s3_filesystem(endpoint: str | None, timeout_s: float) -> Any:
    try:
        import s3fs
    except ImportError:
        raise ConfigError("files_store s3 needs s3fs on the gateway: pip install 'wicore[s3]'") from None
    config = {
        "connect_timeout": timeout_s,
        "read_timeout": timeout_s,
        "retries": {"max_attempts": S3_ATTEMPTS, "mode": "standard"},
    }
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False, "config_kwargs": config}
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, **options) if endpoint else s3fs.S3FileSystem(**options)
    fs.retries = 1  # botocore retries; s3fs's own retries on top would multiply the wait on a hung endpoint
    return fs


def s3_errors() -> tuple[type[Exception], ...]:
    """What an S3 call may raise through s3fs: OSError (its kinds of S3's refusals) and
    botocore's own errors (no credentials, an endpoint that does not answer)."""
    from botocore.exceptions import BotoCoreError

    return (OSError, BotoCoreError)


def shown(endpoint: str | None) -> str:
    """The endpoint without any user or password in its URL; AWS for none."""
    if not endpoint:
        return "AWS"
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def as_bytes(raw: object) -> bytes:
    """A reply of a client that does not decode responses (every client here)."""
    return raw if isinstance(raw, bytes) else str(raw).encode()


def open_store(config: FilesConfig, connection: Redis) -> FileStore:
    if config.store == "redis":
        return RedisStore(connection, config.max_bytes)
    if config.store == "s3":
        return S3Store(config.s3_url, config.s3_endpoint, config.max_bytes, config.s3_timeout_s)
    return FolderStore(config.folder, config.max_bytes)


def lines_from(store: FileStore, file_id: str, offset: int) -> Iterator[tuple[int, bytes]]:
    """(offset just past the line, the line without its newline) for each line from byte
    `offset` on; the last line may lack its newline."""
    buffer = b""
    for piece in store.chunks(file_id, offset):
        *whole, buffer = (buffer + piece).split(b"\n")
        for line in whole:
            offset += len(line) + 1
            yield offset, line
    if buffer:
        yield offset + len(buffer), buffer
