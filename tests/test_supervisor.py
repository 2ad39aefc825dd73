"""`wicore worker --workers N` (the supervisor `--gpus` uses, on CPU): real processes, signals
and a real redis-server. A worker killed with SIGKILL comes back under its name and no job is
lost; SIGTERM stops every worker (twice: their jobs go back to the queues at once); a worker
that cannot start for a usage error ends the supervisor with its line and status."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from redis import Redis
from rq.job import Job, JobStatus

from tests.helpers import (
    WICORE,
    alive,
    children_of,
    claimed_jobs,
    kill_holding_pid,
    process_group_members,
    wait_until,
    wicore,
    write_images,
)
from wicore import keys
from wicore.embedded import EmbeddedRedis
from wicore.producer import Producer, Submission
from wicore.schemas import GenerationParams

pytestmark = pytest.mark.slow

TTL_ENV = {"WICORE_LIVENESS_TTL_S": "2"}  # a killed worker's jobs are requeued within seconds


@pytest.fixture
def server():
    with EmbeddedRedis() as s:
        yield s


def start_supervisor(url: str, log: Path, *args: str, workers: int = 2) -> subprocess.Popen:
    command = [WICORE, "worker", "--workers", str(workers), "--name", "sup", "--redis-url", url, *args]
    with open(log, "wb") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **TTL_ENV})


def worker_pid(connection: Redis, name: str) -> int | None:
    """The process RQ's record of worker `name` names, while that record is there."""
    pid = connection.hget(f"rq:worker:{name}", "pid")
    return int(pid) if pid else None


def wait_for_workers(connection: Redis, supervisor: subprocess.Popen, log: Path, count: int = 2) -> dict[str, int]:
    """Every worker registered, as a child of the supervisor: name -> pid."""
    pids = lambda: {f"sup-{i}": worker_pid(connection, f"sup-{i}") for i in range(count)}  # noqa: E731
    registered = lambda: set(pids().values()) <= set(children_of(supervisor.pid))  # noqa: E731
    wait_until(lambda: None not in pids().values() and registered() or supervisor.poll() is not None, 120, 0.2)
    assert supervisor.poll() is None, log.read_text()
    return pids()


def submit(url: str, paths: list[Path], new_tokens: int) -> list[str]:
    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True)  # every batch takes its full length
    producer = Producer(url, model="tiny")
    return producer.submit_many(Submission(path, "Describe.", params=params) for path in paths)


def statuses(connection: Redis, ids: list[str]) -> list[JobStatus]:
    return [Job.fetch(job_id, connection=connection).get_status() for job_id in ids]


def process_group(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


def test_a_killed_worker_comes_back_and_no_job_is_lost(tmp_path, server, tiny_model_dir):
    connection, log = Redis.from_url(server.url), tmp_path / "supervisor.log"
    supervisor = start_supervisor(server.url, log, "--model", str(tiny_model_dir), "--model-id", "tiny",
                                  "--batch-size", "4")  # fmt: skip
    try:
        first = wait_for_workers(connection, supervisor, log)
        group = process_group(first["sup-0"])
        before = submit(server.url, write_images(tmp_path / "before", 12), new_tokens=48)
        wait_until(lambda: connection.zcard(keys.claims("sup-0")) > 0, 120, 0.05, "sup-0 to hold jobs")
        # the kill lands while sup-0 holds jobs: only the reaping path can bring them back
        held = kill_holding_pid(first["sup-0"], lambda: claimed_jobs(connection, "sup-0"))
        after = submit(server.url, write_images(tmp_path / "after", 6, start=12), new_tokens=48)

        back = lambda: worker_pid(connection, "sup-0") not in (None, first["sup-0"])  # noqa: E731
        wait_until(back, 120, 0.2, "sup-0 registered again")
        again = wait_for_workers(connection, supervisor, log)
        assert again["sup-1"] == first["sup-1"] and not alive(first["sup-0"])
        assert process_group(again["sup-0"]) == group, "the new process joins the others' process group"

        ids = before + after
        finished = lambda: all(s == JobStatus.FINISHED for s in statuses(connection, ids))  # noqa: E731
        wait_until(finished, 300, 0.5, "every job to finish")
        assert all(connection.xlen(f"rq:results:{job_id}") == 1 for job_id in ids), "each job ran to its end once"
        assert set(held) <= set(before)
        assert connection.zcard(keys.claims("sup-0")) == connection.zcard(keys.claims("sup-1")) == 0
    finally:
        supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(timeout=120)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "worker sup-0 was killed by SIGKILL; starting it again in 1s" in text
    assert f"worker sup-0 started again (pid {again['sup-0']})" in text and text.rstrip().endswith("2 workers stopped")
    assert not any(alive(pid) for pid in [*first.values(), *again.values()]) and process_group_members(group) == []
    assert children_of(supervisor.pid) == [] and not connection.smembers("rq:workers")


def test_a_lone_worker_killed_comes_back_in_a_process_group_of_its_own(tmp_path, server):
    """The killed worker was its group's last member: the group is gone, so its successor founds
    a new one (joining the old number could join someone else's group)."""
    connection, log = Redis.from_url(server.url), tmp_path / "supervisor.log"
    supervisor = start_supervisor(server.url, log, "--engine", "null", workers=1)
    first = wait_for_workers(connection, supervisor, log, count=1)["sup-0"]
    old_group = process_group(first)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: worker_pid(connection, "sup-0") not in (None, first), 120, 0.2, "sup-0 registered again")
    second = wait_for_workers(connection, supervisor, log, count=1)["sup-0"]
    assert process_group(second) == second != old_group and process_group_members(old_group) == []
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert not alive(second) and process_group_members(second) == []


def test_sigterm_twice_stops_every_worker_at_once_and_their_jobs_go_back(tmp_path, server, tiny_model_dir):
    connection, log = Redis.from_url(server.url), tmp_path / "supervisor.log"
    supervisor = start_supervisor(server.url, log, "--model", str(tiny_model_dir), "--model-id", "tiny",
                                  "--batch-size", "2")  # fmt: skip
    pids = wait_for_workers(connection, supervisor, log)
    ids = submit(server.url, write_images(tmp_path / "imgs", 8), new_tokens=400)  # batches of many seconds
    holding = lambda: all(connection.zcard(keys.claims(name)) for name in pids)  # noqa: E731
    wait_until(holding, 120, 0.05, "both workers to hold jobs")
    held = [job_id for name in pids for job_id in claimed_jobs(connection, name)]
    supervisor.send_signal(signal.SIGTERM)  # warm: the workers would finish these first ...
    supervisor.send_signal(signal.SIGINT)  # ... but the second signal asks for a cold stop
    assert supervisor.wait(timeout=120) == 0, log.read_text()[-3000:]

    assert not any(alive(pid) for pid in pids.values()) and children_of(supervisor.pid) == []
    assert all(connection.zcard(keys.claims(name)) == 0 for name in pids)
    assert set(statuses(connection, held)) == {JobStatus.QUEUED}, "the jobs in hand are back in their queue"
    assert set(statuses(connection, ids)) == {JobStatus.QUEUED}, "nothing ran to its end"
    assert "cold shutdown, returning" in log.read_text()


def test_a_worker_that_cannot_start_ends_the_supervisor_with_its_line_and_status(tmp_path, server):
    """A usage error only the worker sees (the null engine takes no engine options) is not
    retried: the supervisor stops the other worker and ends with that worker's line."""
    log = tmp_path / "supervisor.log"
    supervisor = start_supervisor(server.url, log, "--engine", "null", "--engine-option", "block_size=8")
    assert supervisor.wait(timeout=120) == 2
    lines = log.read_text().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]] and len(errors) == 1, lines
    assert errors[0].startswith("error: worker sup-") and "the null engine takes no --engine-option" in errors[0]
    assert not any("starting it again" in line for line in lines), "no restart"
    assert children_of(supervisor.pid) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("verb", ["worker", "caption"])
def test_gpus_without_cuda_is_one_line(tmp_path, server, verb):
    image, out = write_images(tmp_path, 1)[0], tmp_path / "out.jsonl"
    args = {"worker": ["worker"], "caption": ["caption", str(image), "-o", str(out)]}[verb]
    run = wicore(*args, "--gpus", "all", "--redis-url", server.url, check=False)
    assert run.returncode == 2 and run.stderr == "error: --gpus all: no CUDA device here; on CPU use --workers N\n"
