"""Redis over its maxmemory for a second or two at a time (every write that needs memory
refused: OOM), under two running workers and a submitting producer, on the embedded Redis 6.2 and
on a Redis 7 (skipped without one): the workers ride each pulse out as they ride out an outage,
results held and written after it, and every job the producer got an id for finishes exactly
once. `python -m bench.maxmemory_pulses` runs the same with twelve pulses of 1-5 s.
"""

from __future__ import annotations

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
