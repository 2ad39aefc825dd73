"""A long-running process's link to Redis: how its client is set up, which errors mean "Redis
cannot take our writes right now" (an outage, to ride out), and how long it waits between tries.
The check before it starts is `wicore.cli.redis_check.connect`'s, which takes `client_options()`.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# Redis is down, restarting (BusyLoadingError: loading its append-only file is a ConnectionError),
# or unreachable.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
# Redis answers but refuses writes for now: over its maxmemory (OOM), a read-only replica
# (READONLY: a failover under way), or unable to persist (MISCONF). redis-py names the first two;
# MISCONF, and a refusal inside a script on Redis 6 ("... @user_script: 1: -OOM ...") come as a
# ResponseError whose text carries the code (after "caused error: " in a pipeline's). A refused
# script ran none of its writes: Redis refuses a script at its first write or not at all.
WRITES_REFUSED = (OutOfMemoryError, ReadOnlyError)
_REFUSAL_CODE = re.compile(r"(?:^|-|caused error: )(OOM|READONLY|MISCONF) ")


def is_outage(error: BaseException) -> bool:
    """Redis is down, or up and refusing writes: either is ridden out (results held, tries with
    backoff). Anything else from Redis is a bug or a bad command, not an outage."""
    if isinstance(error, REDIS_DOWN + WRITES_REFUSED):
        return True
    return isinstance(error, ResponseError) and _REFUSAL_CODE.search(str(error)) is not None


def outage_text(error: BaseException) -> str:
    """What a log line says of an outage: 'Redis unreachable (ConnectionError)', or 'Redis refuses
    writes (OOM command not allowed ...)' from the refusal's code on."""
    if isinstance(error, REDIS_DOWN):
        return f"Redis unreachable ({type(error).__name__})"
    text = str(error)
    code = _REFUSAL_CODE.search(text)
    reason = text[code.start(1) :] if code else f"{type(error).__name__}: {text}"
    return f"Redis refuses writes ({reason[:160]})"


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
