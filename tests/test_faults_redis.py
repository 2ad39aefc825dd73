"""Redis goes away under running workers and a submitting producer, four times: SHUTDOWN and
kill -9 of redis-server, 5 s and 30 s down, restarted each time from its append-only file.
The workers stay up, hold the results of the jobs in hand and write them when Redis is back,
register again, and every job submitted ends finished, exactly once.

The server fsyncs its AOF on every write (`appendfsync always`): with the default `everysec`, a
kill -9 loses up to a second of acknowledged writes, submissions included, which no client can
recover.
"""

from __future__ import annotations

import contextlib
import re
import time
from contextlib import ExitStack

import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.fault_rig import Feeder, Workers, audit, wait_all_ended
from tests.helpers import at_a_frozen_moment, png_bytes, wait_until
from wicore import keys
from wicore.embedded import EmbeddedRedis, free_port

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]  # real outages and restarts: minutes on a loaded machine

OUTAGES = [("shutdown", 5), ("kill -9", 5), ("shutdown", 30), ("kill -9", 30)]
NAMES = ["r0", "r1"]
ARGS = ["--engine", "null", "--model-id", "outage", "--batch-size", "8", "--max-queue-delay-ms", "0"]


def test_workers_ride_out_redis_outages(tmp_path):
    port, data = free_port(), tmp_path / "redis"

    def start_redis() -> EmbeddedRedis:
        return EmbeddedRedis(data, persist=True, port=port, fsync="always").start()

    with ExitStack() as stack:
        server = start_redis()
        stack.callback(lambda: server.stop())
        env = {"WICORE_LIVENESS_TTL_S": "3", "WICORE_LOG_LEVEL": "INFO"}
        workers = stack.enter_context(Workers(server.url, tmp_path / "logs", ARGS, env))
        for name in NAMES:
            workers.start(name)
        feeder = Feeder(server.url, "outage", png_bytes(0, (1000, 1000)), per_tick=8, tick_s=0.25, max_new_tokens=4)
        feeder.start()
        report = []
        for how, down_s in OUTAGES:
            connection = Redis.from_url(server.url)
            held = stop_redis_while_holding(server, connection, workers, how)
            down_at = time.time()  # nothing is written from here until the restart
            time.sleep(down_s)
            assert sorted(workers.alive()) == NAMES, f"a worker died while Redis was away ({how})"
            server = start_redis()
            connection = Redis.from_url(server.url)
            wait_until(
                lambda c=connection: all(registered(c, workers, n) for n in NAMES), 60, what="workers to register"
            )
            kept = results_kept(connection, held, down_at)
            report.append(f"{how} {down_s}s: held {len(held)}, written after restart by their worker {kept}")
            assert kept, f"{how}: no job in hand kept its result across the outage"
        ids = feeder.stop()
        wait_all_ended(connection, ids, timeout=120)
        exits = workers.stop_all()
        queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
        statuses = audit(connection, ids, queues)
        logs = "".join(workers.log(name) for name in NAMES)

    print(f"\nRedis outages: {len(ids)} jobs, {feeder.refused} submit calls refused while away, final {dict(statuses)}")
    print("\n".join(report))
    print("workers:", "; ".join(re.findall(r"Redis is back after [\d.]+s; wrote \d+ of \d+ held results", logs)))
    assert statuses == {"finished": len(set(ids))}, "every job finished, none lost"
    assert set(exits.values()) == {0}, exits


def stop_redis_while_holding(server: EmbeddedRedis, connection: Redis, workers: Workers, how: str) -> dict:
    """Stop Redis at a moment the workers hold jobs, read while they are frozen
    (`at_a_frozen_moment`; they continue once it is down). {job id: (worker, execution id)} of
    what they held."""
    pids = [workers.processes[name].pid for name in workers.alive()]
    return at_a_frozen_moment(
        pids, lambda: claims_with_executions(connection), lambda: stop_redis(server, connection, how)
    )


def claims_with_executions(connection: Redis) -> dict[str, tuple[str, str]]:
    """{job id: (worker, execution id)} of every claimed run (its member: job id:execution id)."""
    held: dict[str, tuple[str, str]] = {}
    for name in NAMES:
        for raw in connection.zrange(keys.claims(name), 0, -1):
            job_id, execution_id = raw.decode().split(":")
            held[job_id] = (name, execution_id)
    return held


def stop_redis(server: EmbeddedRedis, connection: Redis, how: str) -> None:
    if how == "shutdown":
        with contextlib.suppress(RedisError):  # the connection may close under the reply
            connection.shutdown()
    else:
        server.process.kill()
    server.process.wait(timeout=30)


def registered(connection: Redis, workers: Workers, name: str) -> bool:
    return connection.hget(f"rq:worker:{name}", "pid") == str(workers.processes[name].pid).encode()


def results_kept(connection: Redis, held: dict[str, tuple[str, str]], down_at: float) -> int:
    """How many jobs held at the outage got their result from the execution that held them,
    written after Redis came back (computed before or during the outage, kept in memory)."""
    wait_until(lambda: all(connection.hget(f"rq:job:{j}", "status") == b"finished" for j in held), 60, what="held jobs")
    kept = 0
    for job_id, (worker, execution) in held.items():
        [(entry, fields)] = connection.xrange(f"rq:results:{job_id}")
        assert fields[b"worker_name"].decode() == worker and fields[b"execution_id"].decode() == execution, (
            f"{job_id} was run again instead of keeping its result"
        )
        kept += int(entry.decode().split("-")[0]) >= down_at * 1000
    return kept
