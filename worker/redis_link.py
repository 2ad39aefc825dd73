"""A long-running process's link to Redis: how its client is set up, which errors mean "Redis is
not there right now", and how long it waits between tries. The check before it starts is
`wicore.cli.redis_check.connect`'s, which takes `client_options()`.
"""

from __future__ import annotations

import random
import time
from typing import Any

from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# Redis is down, restarting (BusyLoadingError: loading its append-only file is a ConnectionError),
# or unreachable. Anything else from Redis is a bug or a refused command, not an outage.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


def client_options() -> dict[str, Any]:
    """`Redis.from_url` options for a long-running process: it notices an outage within seconds
    (a dead server, or a silent network) and leaves the waiting to the caller, so redis-py's own
    retries stay short."""
    return {
        "socket_timeout": 15,  # above every blocking call we make (BLPOP waits at most ~1 s)
        "retry": Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.01), 2),
    }


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


class PollPace:
    """When a worker turn asks Redis for something it polls (its cancel set): after every engine
    step, since a running job leaves the engine at the next step boundary, else at most every
    `every_s`. A turn that only waits for images to load then costs Redis nothing, however long
    the loading takes."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.stepped = False
        self._next_at = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if not (self.stepped or now >= self._next_at):
            return False
        self.stepped, self._next_at = False, now + self.every_s
        return True
