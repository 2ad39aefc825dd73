"""kill -9 of workers in the middle of their batches, 20 times in one run, while a producer keeps
submitting: nothing is lost, no result is written twice, every job ends visibly in RQ's records.

Real `wicore worker` processes (null engine: the engine does not matter here; each job decodes a
1-megapixel image, so a worker holds its batch for a while), real signals, a real redis-server.
A killed worker is restarted under its own name at once (it takes over its dead record), except
for the kills that time an interactive job's recovery: that worker stays dead until a live
worker's reaper has given its jobs back.
"""

from __future__ import annotations

import socket
import statistics
import time
from contextlib import ExitStack

import pytest
from redis import Redis

from tests.fault_rig import Feeder, Workers, audit, wait_all_ended
from tests.helpers import png_bytes, wait_until
from wicore.embedded import EmbeddedRedis

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]  # real outages and restarts: minutes on a loaded machine

KILLS = 20
TIMED_KILLS = {4, 9, 14, 19}  # kills that time an interactive job's recovery
LIVENESS_TTL_S = 3
ARGS = ["--engine", "null", "--model-id", "kill", "--batch-size", "8", "--max-queue-delay-ms", "0"]


def test_kill_9_mid_batch_20_times(tmp_path):
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedRedis())
        connection = Redis.from_url(server.url)
        env = {"WICORE_LIVENESS_TTL_S": str(LIVENESS_TTL_S), "WICORE_LOG_LEVEL": "INFO"}
        workers = stack.enter_context(Workers(server.url, tmp_path / "logs", ARGS, env))
        names = ["w0", "w1", "w2"]
        for name in names:
            workers.start(name)
        feeder = Feeder(server.url, "kill", png_bytes(0, (1000, 1000)), per_tick=8, tick_s=0.2, max_new_tokens=4)
        feeder.start()
        held_at_kill, recoveries, interactive = [], [], []
        try:
            for k in range(KILLS):
                if k in TIMED_KILLS:
                    name, job_id, held, recovery = time_interactive_recovery(workers, feeder, connection, k)
                    recoveries.append(recovery)
                    interactive.append(job_id)
                else:
                    name = names[k % len(names)]
                    held = workers.kill_holding(name)
                held_at_kill.append(len(held))
                workers.start(name, wait=False)  # under its own name: it takes over its dead record
        finally:
            ids = feeder.stop() + interactive
        wait_all_ended(connection, ids, timeout=180)
        for name in names:  # the last ones restarted are up (a SIGTERM before that is a plain kill)
            workers.wait_registered(name)
        assert sorted(workers.alive()) == names, "only the killed workers died"
        exits = workers.stop_all()
        queues = sorted(k.decode()[len("rq:queue:") :] for k in connection.smembers("rq:queues"))
        statuses = audit(connection, ids, queues)

    print(f"\nkill -9 x{KILLS}: {len(ids)} jobs, jobs held at each kill {held_at_kill}, final {dict(statuses)}")
    print(
        f"interactive job recovery after kill -9 (liveness TTL {LIVENESS_TTL_S}s): "
        + ", ".join(f"{r:.1f}s" for r in recoveries)
        + f"; median {statistics.median(recoveries):.1f}s"
    )
    assert all(held > 0 for held in held_at_kill), "every kill hit a worker in the middle of a batch"
    assert statuses == {"finished": len(set(ids))}, "every job finished, none lost"
    assert set(exits.values()) == {0}, exits


def time_interactive_recovery(workers: Workers, feeder: Feeder, connection: Redis, k: int):
    """Submit a high-lane job, kill -9 the worker that took it while it holds it, and time how
    long after the kill the job has its result (the other workers' reapers give it back).
    Returns (worker name, job id, jobs the worker held, seconds)."""
    for attempt in range(50):
        job_id = feeder.submit_high(png_bytes(1000 + 100 * k + attempt, (1200, 1200)), f"interactive {k}/{attempt}")
        key = f"rq:job:{job_id}"
        wait_until(lambda key=key: connection.hget(key, "status") != b"queued", 60, what="the interactive job to start")
        name = (connection.hget(key, "worker_name") or b"").decode()
        if name not in workers.alive():
            continue
        try:
            held = workers.kill_holding(name, wanted=lambda ids, job_id=job_id: job_id in ids, timeout=5)
        except AssertionError:  # it finished first
            continue
        killed_at = time.monotonic()
        wait_until(lambda key=key: connection.hget(key, "status") == b"finished", 120, what="the interactive job")
        return name, job_id, held, time.monotonic() - killed_at
    raise AssertionError("never caught a worker holding an interactive job")


def test_a_worker_restarted_under_its_name_takes_over_or_waits(tmp_path):
    """kill -9, then the same --name at once: it takes the dead record over (same host, process
    gone) and gives back what its previous life held. A record from another host waits for its
    TTL; a live worker's name is refused with one line."""
    with EmbeddedRedis() as server, Workers(server.url, tmp_path, ARGS, {"WICORE_LOG_LEVEL": "INFO"}) as workers:
        connection = Redis.from_url(server.url)
        workers.start("phoenix")
        feeder = Feeder(server.url, "kill", png_bytes(0, (1000, 1000)), per_tick=8, tick_s=0.2, max_new_tokens=4)
        feeder.start()
        held = workers.kill_holding("phoenix")
        assert connection.exists("rq:worker:phoenix"), "the dead record is still there (15 s TTL)"
        workers.start("phoenix")
        ids = feeder.stop()
        wait_all_ended(connection, ids, timeout=60)
        assert "taking over the record of its dead predecessor" in workers.log("phoenix")
        assert set(held) <= set(ids) and all(connection.hget(f"rq:job:{j}", "status") == b"finished" for j in held)

        elsewhere = {"hostname": "another-host", "pid": "1", "birth": "x", "last_heartbeat": "x"}
        connection.hset("rq:worker:nomad", mapping=elsewhere)
        connection.expire("rq:worker:nomad", 60)  # outlives the worker's start-up, however slow
        workers.start("nomad", wait=False)
        wait_until(lambda: "waiting up to" in workers.log("nomad"), 120, what="nomad to wait for the record")
        assert connection.hget("rq:worker:nomad", "hostname") == b"another-host", "it waits, leaving the record"
        connection.expire("rq:worker:nomad", 1)  # the other host's record reaches its TTL
        workers.wait_registered("nomad")

        twin = Workers(server.url, tmp_path / "twin", ARGS, {"WICORE_LIVENESS_TTL_S": "3"})
        duplicate = twin.start("phoenix", wait=False)
        assert duplicate.wait(timeout=60) == 2
        assert "a live worker named phoenix is running" in twin.log("phoenix")
        assert "phoenix" in workers.alive() and socket.gethostname()
