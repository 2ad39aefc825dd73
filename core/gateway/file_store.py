"""Where the bytes of uploaded files and batch results live: a folder, or Redis for small files.
Both are read and written in pieces (append, read in chunks, lines from an offset), so no file
is ever held whole in a gateway's memory; their metadata lives in Redis (`batch_state`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from redis import Redis

from wicore import keys
from wicore.errors import ConfigError

CHUNK = 1 << 16  # bytes per read


@dataclass(frozen=True)
class FilesConfig:
    store: Literal["folder", "redis"] = "folder"
    folder: Path = Path("wicore-files")
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


def as_bytes(raw: object) -> bytes:
    """A reply of a client that does not decode responses (every client here)."""
    return raw if isinstance(raw, bytes) else str(raw).encode()


def open_store(config: FilesConfig, connection: Redis) -> FileStore:
    if config.store == "redis":
        return RedisStore(connection, config.max_bytes)
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
