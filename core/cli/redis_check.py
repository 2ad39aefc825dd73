"""A verb's first contact with Redis, before anything slow starts (a worker's model load, a
caption run's workers): is it reachable, does it take the credentials, does it take writes?
Each failure is one line naming the URL without its password and saying what to do."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

from redis import Redis
from redis.exceptions import AuthenticationError, ReadOnlyError, RedisError, ResponseError

from wicore import keys
from wicore.errors import ConfigError, RedisUnavailable
from wicore.redaction import redact

CONNECT_TIMEOUT_S = 5.0
URL_FORM = "redis://HOST:6379/0 (a password goes before the host, as :PASSWORD@), rediss:// for TLS, or unix://PATH"


def connect(url: str | None, *, write: bool = True, **options: Any) -> Redis:
    """A checked connection to `url`; with `write`, Redis must also accept a write. `options`:
    more `Redis.from_url` arguments (a worker's: `wicore.worker.redis_link.client_options`)."""
    if not url:
        raise ConfigError(f"this needs a Redis: pass --redis-url ({URL_FORM}) or set WICORE_REDIS_URL")
    try:
        connection = Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, **options)
    except ValueError as exc:
        raise ConfigError(f"--redis-url {redact(url)} is not a Redis URL ({exc}); use {URL_FORM}") from exc
    try:
        connection.ping()
        if write:
            probe = keys.probe(uuid.uuid4().hex)
            connection.set(probe, b"1", px=10_000)
            connection.delete(probe)
    except RedisError as exc:
        raise RedisUnavailable(problem(url, exc)) from exc
    return connection


def connect_shards(urls: list[str], *, write: bool = True, **options: Any) -> list[Redis]:
    """`connect` to each shard of a comma-separated --redis-url (one URL: one shard)."""
    if not urls:
        connect(None)
    return [connect(url, write=write, **options) for url in urls]


def db_index(url: str) -> str:
    """The database number a Redis URL names: its path ('/3') or its ?db= query; '0' by default."""
    parts = urlsplit(url)
    query = dict(pair.split("=", 1) for pair in parts.query.split("&") if "=" in pair)
    return parts.path.strip("/") or query.get("db", "0")


def problem(url: str, exc: RedisError) -> str:
    shown = redact(url)
    if isinstance(exc, AuthenticationError):
        if urlsplit(url).password is None:
            return f"Redis at {shown} wants a password: put it in the URL before the host, as :PASSWORD@"
        return f"Redis at {shown} refused the user name or password in the URL"
    if isinstance(exc, ReadOnlyError):
        return f"Redis at {shown} is a read-only replica: point --redis-url at the primary"
    if isinstance(exc, ResponseError) and "DB index" in str(exc):
        db = db_index(url)
        return (
            f"Redis at {shown} has no database {db} ({exc}): use a number below its `databases` setting (16 by default)"
        )
    if isinstance(exc, ResponseError):
        return f"Redis at {shown} refuses writes ({exc}): check its memory limit and persistence errors"
    return f"cannot reach Redis at {shown} ({exc}): is redis-server running there? check --redis-url"
