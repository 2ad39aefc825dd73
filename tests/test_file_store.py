"""The batch file stores (a folder, Redis, an S3 bucket) on a real redis-server and a real
S3-compatible server on loopback (moto's server mode): appends, reads in pieces, lines from any
offset across piece boundaries, truncation back to a committed size; a missing bucket, a bad URL
and an endpoint that went away, each said in one line."""

from __future__ import annotations

import signal

import pytest

from tests.url_servers import BUCKET, moto_process, s3_server
from wicore.errors import ConfigError, FileStoreUnavailable
from wicore.gateway.file_store import CHUNK, FolderStore, RedisStore, S3Store, lines_from


@pytest.fixture(scope="module")
def s3_endpoint():
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(params=["folder", "redis", "s3"])
def store(request, tmp_path, redis_conn):
    if request.param == "folder":
        return FolderStore(tmp_path / "files", max_bytes=2**30)
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        return S3Store(f"s3://{BUCKET}/{tmp_path.name}/files", endpoint, max_bytes=2**30)
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


def test_a_cut_inside_an_object_keeps_its_head(store):
    store.append("file-c", b"one\ntwo\nthree\n")
    store.truncate("file-c", 4)
    store.append("file-c", b"four\n")
    assert b"".join(store.chunks("file-c")) == b"one\nfour\n"
    assert b"".join(store.chunks("file-c", 6)) == b"ur\n"


def test_s3_files_are_objects_under_the_prefix(s3_endpoint):
    import s3fs

    store = S3Store(f"s3://{BUCKET}/under/here/", s3_endpoint, max_bytes=2**30)
    store.append("file-d", b"a\n")
    store.append("file-d", b"b\n")
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True, use_listings_cache=False)
    assert fs.ls(f"{BUCKET}/under/here/file-d") == [
        f"{BUCKET}/under/here/file-d/0000000000000000",
        f"{BUCKET}/under/here/file-d/0000000000000002",
    ]
    store.delete("file-d")
    assert not fs.exists(f"{BUCKET}/under/here/file-d/0000000000000000")


@pytest.mark.parametrize(
    "url, said",
    [
        ("s3://no-such-bucket/files", "no bucket 'no-such-bucket'"),
        ("http://example.com/files", "is not an s3://bucket/prefix URL"),
        ("", "files_store s3 needs files_s3_url"),
    ],
)
def test_a_bucket_that_cannot_be_used_is_a_config_error(s3_endpoint, url, said):
    with pytest.raises(ConfigError, match=said) as caught:
        S3Store(url, s3_endpoint, max_bytes=2**30)
    assert "\n" not in str(caught.value) and "testing" not in str(caught.value)


def test_an_endpoint_is_shown_without_its_password(s3_endpoint):
    with_user = s3_endpoint.replace("http://", "http://user:hunter2@")
    with pytest.raises(ConfigError) as caught:
        S3Store("s3://no-such-bucket/files", with_user, max_bytes=2**30)
    assert "hunter2" not in str(caught.value) and s3_endpoint in str(caught.value)


def test_an_endpoint_gone_is_the_store_unavailable_until_it_is_back(s3_endpoint):
    from moto.server import ThreadedMotoServer

    from tests.url_servers import free_port

    port = free_port()
    with pytest.raises(ConfigError, match="cannot reach the bucket"):
        S3Store(f"s3://{BUCKET}/files", f"http://127.0.0.1:{port}", max_bytes=2**30)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()  # moto's buckets live in this process: the fixture's are here too
    store = S3Store(f"s3://{BUCKET}/gone", f"http://127.0.0.1:{port}", max_bytes=2**30)
    store.append("file-e", b"kept\n")
    server.stop()
    with pytest.raises(FileStoreUnavailable, match=f"s3://{BUCKET}/gone/: EndpointConnectionError"):
        store.append("file-e", b"lost\n")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        assert store.append("file-e", b"more\n") == 10
        assert b"".join(store.chunks("file-e")) == b"kept\nmore\n"
    finally:
        server.stop()


@pytest.mark.faults
def test_an_endpoint_that_hangs_is_the_store_unavailable_within_its_timeout(tmp_path):
    """moto_server stopped (SIGSTOP): its socket takes connections and never answers. Every
    call ends unavailable after the timeout, a PUT too (no wait for a `100 Continue`)."""
    from tests.url_servers import free_port

    port = free_port()
    server = moto_process(port, tmp_path / "moto.log")
    try:
        store = S3Store(f"s3://{BUCKET}/hung", f"http://127.0.0.1:{port}", max_bytes=2**30, timeout_s=1)
        store.append("file-f", b"a\n")
        server.send_signal(signal.SIGSTOP)
        for call in (
            lambda: store.append("file-f", b"b\n"),
            lambda: store.size("file-f"),
            lambda: list(store.chunks("file-f")),
        ):
            with pytest.raises(FileStoreUnavailable, match="ReadTimeoutError"):
                call()
        server.send_signal(signal.SIGCONT)
        assert store.size("file-f") in (2, 4)  # the PUT that timed out may land once the server goes on
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
