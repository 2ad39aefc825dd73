"""Image bytes by URL, fetched where the image is decoded (a worker's decode process or thread),
bounded in size and time.

http(s)://: the host is resolved here and every address it resolves to is checked against the
policy before a connection is made; the connection goes to a checked address (a second lookup
cannot swap it), with the URL's host name kept for the Host header and TLS. Each redirect is a
new URL, checked the same way. Private, loopback and other non-public addresses are refused
unless `allow_private` is on or the host is on the allow list; link-local ones (169.254.0.0/16,
the cloud metadata service) only when the allow list names them.

s3://: through s3fs (the `urls` extra), with the standard AWS credential chain and, for an
S3-compatible store, the endpoint of `s3_endpoint_url`.

Every failure is an `ImageFetchError` naming the URL (password and query values masked) and why.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urljoin, urlsplit

from wicore.errors import ImageFetchError, ImageTooLarge
from wicore.redaction import masked_url

URL_SCHEMES = ("http://", "https://", "s3://")
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 256 * 1024
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_url(text: str) -> bool:
    return text[:8].lower().startswith(URL_SCHEMES)


@dataclass(frozen=True)
class UrlPolicy:
    allow_private: bool = False  # private, loopback, unique-local addresses (link-local still refused)
    # Host names ('images.example.com'; '.example.com' for its subdomains too), addresses or networks
    # ('10.0.0.0/8'). allow_hosts, when given, is the only hosts fetched from; it also admits their
    # non-public addresses. deny_hosts wins over both.
    allow_hosts: tuple[str, ...] = ()
    deny_hosts: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    timeout_s: float = 30.0  # the whole fetch, redirects and body included
    max_redirects: int = 3
    s3_endpoint_url: str | None = None


def fetch_url(url: str, policy: UrlPolicy, max_bytes: int) -> bytes:
    """The bytes at `url` (at most `max_bytes`); raises `ImageFetchError` or `ImageTooLarge`."""
    if url[:5].lower() == "s3://":
        return _fetch_s3(url, policy, max_bytes)
    deadline = time.monotonic() + policy.timeout_s
    current = url
    for _ in range(policy.max_redirects + 1):
        try:
            location = _fetch_http(current, policy, max_bytes, deadline)
        except (ImageFetchError, ImageTooLarge) as exc:
            if current == url:
                raise
            raise type(exc)(f"{masked_url(url)}: redirected to {exc}") from None
        if isinstance(location, bytes):
            return location
        current = urljoin(current, location)
    raise ImageFetchError(f"{masked_url(url)}: more than {policy.max_redirects} redirects")


# -- http(s) ----------------------------------------------------------------------------------


def _fetch_http(url: str, policy: UrlPolicy, max_bytes: int, deadline: float) -> bytes | str:
    """The body, or the Location a redirect points to."""
    parts = _http_parts(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    response = _first_connected(url, parts, _checked_addresses(url, host, port, policy), port, policy, deadline)
    try:
        if response.status in REDIRECTS:
            return _location(url, response)
        if response.status != 200:
            raise ImageFetchError(f"{masked_url(url)}: HTTP {response.status} {response.reason or ''}".rstrip())
        return _body(url, response, max_bytes, deadline)
    finally:
        response.close()  # the connection too: an unread body is never drained


def _http_parts(url: str):
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise ImageFetchError(f"{masked_url(url)}: not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ImageFetchError(f"{masked_url(url)}: only http(s):// URLs with a host are fetched (and s3://)")
    return parts


def _location(url: str, response) -> str:
    location = response.headers.get("Location")
    if not location:
        raise ImageFetchError(f"{masked_url(url)}: HTTP {response.status} redirect without a Location")
    if not urljoin(url, location).lower().startswith(("http://", "https://")):
        raise ImageFetchError(f"{masked_url(url)}: redirects to a URL that is not http(s)")
    return location


def _first_connected(url: str, parts, addresses: list[IPAddress], port: int, policy: UrlPolicy, deadline: float):
    """The response from the first address that takes the connection (a host may resolve to an
    IPv6 address this machine cannot reach, and an IPv4 one it can)."""
    import urllib3

    for address in addresses[:-1]:
        try:
            return _request(parts, address, port, policy, deadline)
        except urllib3.exceptions.NewConnectionError:
            continue
        except urllib3.exceptions.HTTPError as exc:
            raise ImageFetchError(f"{masked_url(url)}: {_reason(exc)}") from None
    try:
        return _request(parts, addresses[-1], port, policy, deadline)
    except urllib3.exceptions.HTTPError as exc:
        raise ImageFetchError(f"{masked_url(url)}: {_reason(exc)}") from None


def _request(parts, address: IPAddress, port: int, policy: UrlPolicy, deadline: float):
    import urllib3

    left = max(deadline - time.monotonic(), 0.001)
    timeout = urllib3.Timeout(connect=min(policy.connect_timeout_s, left), read=left)
    pool = _pool(parts.scheme.lower(), str(address), port, parts.hostname, timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"Host": parts.netloc.rpartition("@")[2], "Accept-Encoding": "identity", "User-Agent": "wicore"}
    if parts.username is not None:
        headers.update(urllib3.make_headers(basic_auth=f"{parts.username}:{parts.password or ''}"))
    return pool.urlopen("GET", path, headers=headers, redirect=False, retries=False, preload_content=False)


def _pool(scheme: str, address: str, port: int, hostname: str, timeout):
    """A connection pool to the checked address; TLS verifies the certificate for `hostname`."""
    import urllib3

    if scheme == "https":
        return urllib3.HTTPSConnectionPool(
            address, port, timeout=timeout, maxsize=1, server_hostname=hostname, assert_hostname=hostname
        )
    return urllib3.HTTPConnectionPool(address, port, timeout=timeout, maxsize=1)


def _reason(exc: Exception) -> str:
    """urllib3's error, less the pool's repr (it names the address, not the URL)."""
    import urllib3

    if isinstance(exc, urllib3.exceptions.NewConnectionError):  # a ConnectTimeoutError to urllib3
        return "cannot connect (connection refused or unreachable)"
    if isinstance(exc, urllib3.exceptions.ConnectTimeoutError):
        return "no connection within the connect timeout"
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError | TimeoutError | socket.timeout):
        return "the server did not answer within the timeout"
    if isinstance(exc, urllib3.exceptions.SSLError):
        return f"TLS failed ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _body(url: str, response, max_bytes: int, deadline: float) -> bytes:
    """Read in chunks, stopping past `max_bytes` or the deadline; a declared length over the cap
    is refused before any byte of the body is read."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ImageTooLarge(f"{masked_url(url)}: {int(declared):,} bytes is over the {max_bytes:,}-byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise ImageFetchError(f"{masked_url(url)}: not fetched within the timeout")
        chunk = _read(url, response)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ImageTooLarge(f"{masked_url(url)}: body is over the {max_bytes:,}-byte limit")
        chunks.append(chunk)


def _read(url: str, response) -> bytes:
    import urllib3

    try:
        return response.read(CHUNK_BYTES)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise ImageFetchError(f"{masked_url(url)}: {_reason(exc)}") from None


# -- the address policy -----------------------------------------------------------------------


def _checked_addresses(url: str, host: str, port: int, policy: UrlPolicy) -> list[IPAddress]:
    """The addresses `host` resolves to, once every one of them passed the policy."""
    addresses = list(dict.fromkeys(_resolve(url, host, port)))
    for address in addresses:
        refusal = refusal_of(host, address, policy)
        if refusal:
            raise ImageFetchError(f"{masked_url(url)}: refused: {refusal}")
    if not addresses:
        raise ImageFetchError(f"{masked_url(url)}: host {host!r} resolves to no address")
    return addresses


def _resolve(url: str, host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageFetchError(f"{masked_url(url)}: cannot resolve host {host!r} ({exc})") from None
    return [_unmapped(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos]


def _unmapped(address: IPAddress) -> IPAddress:
    """::ffff:127.0.0.1 is 127.0.0.1 to the network stack, so to the policy too."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def refusal_of(host: str, address: IPAddress, policy: UrlPolicy) -> str:
    """Why the policy refuses this host at this address ("" when it does not)."""
    if _listed(host, address, policy.deny_hosts):
        return f"{host} ({address}) is on the deny list (url_deny_hosts)"
    allowed = _listed(host, address, policy.allow_hosts)
    if address.is_link_local and not allowed:
        return f"{address} is a link-local address (cloud metadata lives there); list it in url_allow_hosts to allow"
    if policy.allow_hosts and not allowed:
        return f"{host} is not on the allow list (url_allow_hosts)"
    if allowed or address.is_global:
        return ""
    if policy.allow_private and (address.is_private or address.is_loopback):
        return ""
    return f"{address} is not a public address; set allow_private_urls or list the host in url_allow_hosts"


def _listed(host: str, address: IPAddress, entries: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(_matches(entry.lower(), host, address) for entry in entries)


def _matches(entry: str, host: str, address: IPAddress) -> bool:
    network = _network(entry)
    if network is not None:
        return address.version == network.version and address in network
    if entry.startswith("."):
        return host == entry[1:] or host.endswith(entry)
    return host == entry


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


# -- s3 ---------------------------------------------------------------------------------------


def _fetch_s3(url: str, policy: UrlPolicy, max_bytes: int) -> bytes:
    fs = _s3_filesystem(policy.s3_endpoint_url, policy.connect_timeout_s, policy.timeout_s)
    try:
        size = int(fs.info(url)["size"])
        if size > max_bytes:
            raise ImageTooLarge(f"{masked_url(url)}: {size:,} bytes is over the {max_bytes:,}-byte limit")
        with fs.open(url, "rb", block_size=min(max(size, 1), 8 * 2**20)) as source:
            data = source.read(max_bytes + 1)
    except FileNotFoundError:
        raise ImageFetchError(f"{masked_url(url)}: no such object") from None
    except PermissionError as exc:
        raise ImageFetchError(f"{masked_url(url)}: access denied ({_first_line(exc)})") from None
    except ImageTooLarge:
        raise
    except Exception as exc:  # botocore's and aiohttp's many types: each is this URL's failure
        raise ImageFetchError(f"{masked_url(url)}: {type(exc).__name__}: {_first_line(exc)}") from None
    if len(data) > max_bytes:
        raise ImageTooLarge(f"{masked_url(url)}: over the {max_bytes:,}-byte limit")
    return data


@lru_cache(maxsize=4)
def _s3_filesystem(endpoint: str | None, connect_timeout_s: float, timeout_s: float) -> Any:
    try:
        import s3fs
    except ImportError:
        raise ImageFetchError("s3:// images need s3fs on the worker: pip install 'wicore[urls]'") from None
    config = {"connect_timeout": connect_timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 2}}
    options: dict[str, Any] = {"config_kwargs": config, "skip_instance_cache": True}
    if endpoint:
        options["endpoint_url"] = endpoint
    return s3fs.S3FileSystem(**options)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
