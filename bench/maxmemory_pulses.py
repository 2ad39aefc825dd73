"""Maxmemory pulses under load, the acceptance run: twelve pulses of 1-5 s (Redis refuses every
write that needs memory) on a Redis 7, under two `wicore worker`s (null engine, CPU) and jobs
submitted at 80 a second, by the Python producer or (`--via gateway`) by a client posting to a
`wicore serve` on loopback. Checks that both workers live through every pulse, that every job
acknowledged (an id from the producer, a 202 from the gateway) finished exactly once and that the
gateway refused only with 503 + Retry-After; writes the counts as JSON.

    python -m bench.maxmemory_pulses [--via gateway] [--out bench/results/maxmemory-pulses.json]

(from the repository root; it reuses the fault tests' rig, tests/fault_rig.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from redis import Redis

from tests.fault_rig import pulses_under_load, redis_7_binary, redis_server

PULSES_S = [1.0, 5.0, 2.0, 4.0, 3.0, 1.5, 4.5, 2.5, 3.5, 1.0, 5.0, 2.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Write the report here as JSON.")
    parser.add_argument("--major", type=int, default=7, choices=[6, 7], help="Redis major version.")
    parser.add_argument("--via", default="producer", choices=["producer", "gateway"], help="Who submits the jobs.")
    options = parser.parse_args()
    if options.major == 7 and redis_7_binary() is None:
        raise SystemExit("no redis-server 7 on PATH: apt-get install redis-server")
    with tempfile.TemporaryDirectory() as folder, redis_server(options.major) as server:
        version = server_version(server.url)
        start = time.monotonic()
        report = pulses_under_load(server.url, Path(folder) / "logs", PULSES_S, via=options.via)
    report |= {"redis": version, "pulses_s": PULSES_S, "wall_s": round(time.monotonic() - start, 1)}
    text = json.dumps(report, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text + "\n")


def server_version(url: str) -> str:
    return str(Redis.from_url(url).info("server")["redis_version"])


if __name__ == "__main__":
    main()
