"""The batch file stores (a folder, Redis) on a real redis-server: appends, reads in pieces,
lines from any offset across piece boundaries, truncation back to a committed size."""

from __future__ import annotations

import pytest

from wicore.gateway.file_store import CHUNK, FolderStore, RedisStore, lines_from


@pytest.fixture(params=["folder", "redis"])
def store(request, tmp_path, redis_conn):
    if request.param == "folder":
        return FolderStore(tmp_path / "files", max_bytes=2**30)
    return RedisStore(redis_conn, max_bytes=2**30)


def test_lines_from_every_offset_across_piece_boundaries(store):
    lines = [(b"x" * (i * 977 % 5000)) + str(i).encode() for i in range(120)]  # some span pieces
    data = b"\n".join(lines) + b"\n" + b"last line without its newline"
    for start in range(0, len(data), 40_000):
        assert store.append("file-a", data[start : start + 40_000]) == min(len(data), start + 40_000)
    assert len(data) > 3 * CHUNK and store.size("file-a") == len(data)
    assert b"".join(store.chunks("file-a")) == data
    read = list(lines_from(store, "file-a", 0))
    assert [line for _, line in read] == [*lines, b"last line without its newline"]
    for end, line in read[:-1]:
        assert data[end - len(line) - 1 : end] == line + b"\n"
    middle = read[60][0]
    assert [line for _, line in lines_from(store, "file-a", middle)] == [line for _, line in read[61:]]


def test_truncate_cuts_back_to_a_committed_size(store):
    store.append("file-b", b"one\ntwo\n")
    store.append("file-b", b"three\n")
    store.truncate("file-b", 8)
    assert b"".join(store.chunks("file-b")) == b"one\ntwo\n"
    store.truncate("file-b", 100)  # never grows
    assert store.size("file-b") == 8
    store.delete("file-b")
    assert store.size("file-b") == 0 and list(store.chunks("file-b")) == []
