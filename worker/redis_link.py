"""A long-running process's link to Redis: how it connects, how it checks the server before it
starts, which errors mean "Redis is not there right now", and how long it waits between tries.
"""

from __future__ import annotations

import random
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from wicore.errors import ConfigError

# Redis is down, restarting (BusyLoadingError: loading its append-only file is a ConnectionError),
# or unreachable. Anything else from Redis is a bug or a refused command, not an outage.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


def connect(url: str) -> Redis:
    """A client that notices an outage within seconds (a dead server, or a silent network) and
    leaves the waiting to the caller: redis-py's own retries stay short."""
    return Redis.from_url(
        url,
        socket_connect_timeout=5,
        socket_timeout=15,  # above every blocking call we make (BLPOP waits at most ~1 s)
        retry=Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.01), 2),
    )


def redact_url(url: str) -> str:
    """The URL without its user and password (what may be printed)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def check_redis(url: str) -> None:
    """Reachable and authenticated, or a one-line ConfigError that names no credential."""
    where = redact_url(url)
    try:
        with Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5) as connection:
            connection.ping()
    except AuthenticationError:
        raise ConfigError(f"Redis at {where} refused the credentials: check the URL's user and password") from None
    except ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise ConfigError(f"Redis at {where} wants a password: put it in the URL (redis://:PASS@host)") from None
        raise ConfigError(f"Redis at {where} answered with an error: {str(exc).splitlines()[0]}") from None
    except (RedisError, ValueError) as exc:
        raise ConfigError(f"cannot reach Redis at {where} ({type(exc).__name__}): is it running?") from None


class Backoff:
    """Exponential waits with jitter (half to all of the step), so workers that lost Redis
    together do not all knock at the same moment."""

    first_s = 0.1
    most_s = 5.0

    def __init__(self) -> None:
        self.tries = 0

    def next(self) -> float:
        step = min(self.most_s, self.first_s * 2**self.tries)
        self.tries += 1
        return random.uniform(step / 2, step)
