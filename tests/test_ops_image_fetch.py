"""Image URLs as the worker fetches them (`ops.image_fetch`), against real servers on loopback:
what the URL policy refuses (before any connection), and every way a server can fail a fetch,
each an `ImageError` line naming the URL with its credentials masked."""

from __future__ import annotations

import hashlib
import time

import pytest

from tests.url_servers import BUCKET, EXAMPLES, HUGE_BYTES, image_http_server, s3_server
from wicore.errors import ImageFetchError, ImageTooLarge
from wicore.ops.image_fetch import UrlPolicy, fetch_url, refusal_of

LOOPBACK = UrlPolicy(allow_hosts=("127.0.0.1",), timeout_s=2.0, connect_timeout_s=1.0)
MiB = 2**20


@pytest.fixture(scope="module")
def http_base():
    with image_http_server() as base:
        yield base


def example(name: str) -> bytes:
    return (EXAMPLES / name).read_bytes()


def test_an_allowed_url_gives_the_files_bytes(http_base):
    name = "red-star-on-purple.png"
    assert fetch_url(f"{http_base}/img/{name}", LOOPBACK, MiB) == example(name)
    assert fetch_url(f"{http_base}/to-img/{name}", LOOPBACK, MiB) == example(name), "a redirect is followed"
    private = UrlPolicy(allow_private=True)
    assert fetch_url(f"{http_base}/img/{name}?v=1", private, MiB) == example(name)


def test_loopback_is_refused_by_default_with_the_url_masked(http_base):
    url = http_base.replace("http://", "http://me:hunter2@") + "/img/a.png?token=abc123"
    with pytest.raises(ImageFetchError) as caught:
        fetch_url(url, UrlPolicy(), MiB)
    masked = http_base.replace("http://", "http://me:***@") + "/img/a.png?token=***"
    assert str(caught.value) == (
        f"{masked}: refused: 127.0.0.1 is not a public address; set allow_private_urls or list the host in url_allow_hosts"
    )
    assert "hunter2" not in str(caught.value) and "abc123" not in str(caught.value)


@pytest.mark.parametrize("policy", [UrlPolicy(), UrlPolicy(allow_private=True), LOOPBACK])
def test_the_metadata_address_is_refused_unless_listed(policy):
    start = time.monotonic()
    with pytest.raises(
        ImageFetchError, match=r"169\.254\.169\.254 is a link-local address \(cloud metadata lives there\)"
    ):
        fetch_url("http://169.254.169.254/latest/meta-data/", policy, MiB)
    assert time.monotonic() - start < 1.0, "refused before any connection"


def test_a_redirect_is_checked_again(http_base):
    with pytest.raises(
        ImageFetchError,
        match=r"/to-metadata: redirected to http://169\.254\.169\.254/latest/meta-data/: refused: 169\.254",
    ):
        fetch_url(f"{http_base}/to-metadata", UrlPolicy(allow_private=True), MiB)


def test_deny_wins_and_allow_lists_are_the_only_hosts():
    loopback = __import__("ipaddress").ip_address("127.0.0.1")
    public = __import__("ipaddress").ip_address("93.184.215.14")
    both = UrlPolicy(allow_hosts=("127.0.0.0/8",), deny_hosts=("localhost",))
    assert "deny list" in refusal_of("localhost", loopback, both)
    assert refusal_of("127.0.0.1", loopback, both) == ""
    assert "not on the allow list" in refusal_of("example.com", public, UrlPolicy(allow_hosts=(".example.org",)))
    assert refusal_of("img.example.org", public, UrlPolicy(allow_hosts=(".example.org",))) == ""
    assert refusal_of("example.com", public, UrlPolicy()) == ""


@pytest.mark.parametrize(
    ("route", "error", "message"),
    [
        ("missing", ImageFetchError, r"/missing: HTTP 404 Not Found$"),
        ("hang", ImageFetchError, r"/hang: the server did not answer within the timeout$"),
        ("loop", ImageFetchError, r"/loop: more than 3 redirects$"),
        ("huge", ImageTooLarge, rf"/huge: {HUGE_BYTES:,} bytes is over the 1,048,576-byte limit$"),
        ("endless", ImageTooLarge, r"/endless: body is over the 1,048,576-byte limit$"),
    ],
)
def test_each_bad_answer_is_its_own_error_within_the_timeout(http_base, route, error, message):
    start = time.monotonic()
    with pytest.raises(error, match=message):
        fetch_url(f"{http_base}/{route}", LOOPBACK, MiB)
    assert time.monotonic() - start < LOOPBACK.timeout_s + 3


def test_nothing_listens():
    from tests.url_servers import free_port

    with pytest.raises(ImageFetchError, match=r"cannot connect"):
        fetch_url(f"http://127.0.0.1:{free_port()}/a.png", LOOPBACK, MiB)


def test_s3_objects_through_an_s3_compatible_endpoint():
    with s3_server() as endpoint:
        policy = UrlPolicy(s3_endpoint_url=endpoint, timeout_s=10)
        for path in sorted(EXAMPLES.iterdir()):
            data = fetch_url(f"s3://{BUCKET}/examples/{path.name}", policy, MiB)
            assert hashlib.sha256(data).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
        with pytest.raises(ImageFetchError, match=rf"^s3://{BUCKET}/examples/nope.png: no such object$"):
            fetch_url(f"s3://{BUCKET}/examples/nope.png", policy, MiB)
        with pytest.raises(ImageTooLarge, match=r"over the 100-byte limit$"):
            fetch_url(f"s3://{BUCKET}/examples/red-star-on-purple.png", policy, 100)
