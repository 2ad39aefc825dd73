"""Streaming jobs' text, published to Redis as the engine generates it: one Redis stream per job
(`keys.tokens`), one entry `{at, text}` per engine step that added text, capped in length and
expiring `TTL_S` after its last entry. The gateway follows it (`wicore.gateway.streaming`); the
job's result carries the whole text, so a lost or trimmed entry costs the reader only latency."""

from __future__ import annotations

from redis import Redis

from wicore import keys
from wicore.engines.base import TextDelta

MAXLEN = 1024  # entries kept per job (approximate trim: Redis cuts whole macro-nodes)
TTL_S = 600  # a token stream outlives its job's last step by this much


def publish(connection: Redis, deltas: list[tuple[str, TextDelta]]) -> None:
    """(job id, delta) pairs, in one round trip."""
    with connection.pipeline(transaction=False) as pipe:
        for job_id, delta in deltas:
            key = keys.tokens(job_id)
            pipe.xadd(key, {"at": delta.at, "text": delta.text}, maxlen=MAXLEN, approximate=True)
            pipe.expire(key, TTL_S)
        pipe.execute()
