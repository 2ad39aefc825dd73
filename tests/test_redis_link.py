"""Which Redis errors a worker rides out as outages, as real servers word them: unreachable, over
its maxmemory (a command, a script's first write and a transaction, on Redis 6.2 and 7), a
read-only replica, failing to persist; and errors that are no outage."""

from __future__ import annotations

import shutil

import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.fault_rig import redis_server
from tests.helpers import wait_until
from wicore.embedded import EmbeddedRedis, free_port
from wicore.worker.redis_link import is_outage, outage_text

SCRIPT_WRITE = "redis.call('GET', KEYS[1]) return redis.call('SET', KEYS[1], 'v')"


def refusals(connection: Redis) -> list[RedisError]:
    """What a plain write, a script's first write and a transaction raise."""
    calls = [
        lambda: connection.set("k", "v"),
        lambda: connection.eval(SCRIPT_WRITE, 1, "k"),
        lambda: connection.pipeline().set("k", "v").incr("n").execute(),
    ]
    errors = []
    for call in calls:
        with pytest.raises(RedisError) as caught:
            call()
        errors.append(caught.value)
    return errors


def assert_refusals(errors: list[RedisError], code: str) -> None:
    for error in errors:
        assert is_outage(error), repr(error)
        text = outage_text(error)
        assert text.startswith("Redis refuses writes (") and (code in text or type(error).__name__ in text), text


@pytest.mark.parametrize("major", [6, 7])
def test_a_redis_over_its_maxmemory_is_an_outage(major):
    with redis_server(major) as server:
        connection = Redis.from_url(server.url)
        connection.config_set("maxmemory", 1)
        try:
            assert_refusals(refusals(connection), "OOM")
        finally:
            connection.config_set("maxmemory", 0)
        assert connection.set("k", "v")


@pytest.mark.parametrize("major", [6, 7])
def test_a_read_only_replica_is_an_outage(major):
    with redis_server(major) as primary, redis_server(major) as replica:
        connection = Redis.from_url(replica.url)
        connection.replicaof("127.0.0.1", primary.port)
        try:
            assert_refusals(refusals(connection), "READONLY")
        finally:
            connection.replicaof("NO", "ONE")


def test_a_redis_failing_to_persist_is_an_outage(tmp_path):
    """stop-writes-on-bgsave-error (the default) with a snapshot that cannot be written: MISCONF."""
    with EmbeddedRedis() as server:
        connection = Redis.from_url(server.url)
        gone = tmp_path / "gone"
        gone.mkdir()
        connection.config_set("dir", str(gone))
        shutil.rmtree(gone)
        connection.config_set("save", "3600 1")
        connection.bgsave()
        wait_until(lambda: connection.info("persistence")["rdb_last_bgsave_status"] == "err", 10)
        assert_refusals(refusals(connection), "MISCONF")


def test_other_errors_are_no_outage():
    with EmbeddedRedis() as server:
        connection = Redis.from_url(server.url)
        connection.lpush("list", 1)
        for call in (lambda: connection.hget("list", "f"), lambda: connection.eval("return redis.call('NOPE')", 0)):
            with pytest.raises(RedisError) as caught:
                call()
            assert not is_outage(caught.value), repr(caught.value)


def test_an_unreachable_redis_is_an_outage():
    connection = Redis(port=free_port(), socket_connect_timeout=1)
    with pytest.raises(RedisError) as caught:
        connection.ping()
    assert is_outage(caught.value) and outage_text(caught.value) == "Redis unreachable (ConnectionError)"
