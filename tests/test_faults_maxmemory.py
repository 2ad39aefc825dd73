"""Redis over its maxmemory for a second or two at a time (every write that needs memory
refused: OOM), under two running workers and a submitting producer, on the embedded Redis 6.2 and
on a Redis 7 (skipped without one): the workers ride each pulse out as they ride out an outage,
results held and written after it, and every job the producer got an id for finishes exactly
once. Through a `wicore serve` too: every refusal a 503 with Retry-After, every 202 finished
once. `python -m bench.maxmemory_pulses [--via gateway]` runs the same with twelve pulses of 1-5 s.
"""

from __future__ import annotations

import signal

import pytest

from tests.fault_rig import pulses_under_load, redis_server

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]


@pytest.mark.parametrize("major", [6, 7])
def test_workers_ride_out_maxmemory_pulses(tmp_path, major):
    with redis_server(major) as server:
        report = pulses_under_load(server.url, tmp_path / "logs", pulses=[1.0, 2.0])
    print(f"\nRedis {major} maxmemory pulses: {report}")
    assert report["statuses"] == {"finished": report["jobs"]}, "every job finished, none lost"
    assert report["worker_outages"] >= 1, "no worker met a refused write: the pulses tested nothing"


def test_gateway_submitters_get_503s_with_retry_after_and_workers_ride_out_pulses(tmp_path):
    """The same through `wicore serve` on Redis 7: every answer a 202 or a 503 with Retry-After
    (checked by the rig), 503s during the pulses, every 202's job finished exactly once."""
    with redis_server(7) as server:
        report = pulses_under_load(server.url, tmp_path / "logs", pulses=[1.0, 1.5, 1.0], gap_s=0.7, via="gateway")
    print(f"\nRedis 7 maxmemory pulses through the gateway: {report}")
    assert report["statuses"] == {"finished": report["jobs"]} and report["jobs"] == report["acknowledged_202"]
    assert report["refused_503_with_retry_after"] > 0, "no 503 came: the pulses tested nothing"
    assert report["refused_503_during_pulses"] == report["refused_503_with_retry_after"], "a 503 outside the pulses"
    assert report["exits"] == {"m0": 0, "m1": 0}, report
    assert report["gateway_exit"] == -signal.SIGTERM, report  # uvicorn re-raises the signal it shut down on
    assert report["gateway_tracebacks"] == 0, report
