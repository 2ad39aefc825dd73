"""`wicore caption` owns its child processes: a signal mid-run stops all of them (checked by PID
and process group in /proc), leaves a valid output file, and a rerun finishes the rest. With an
external Redis it takes its unstarted jobs back out. Through the installed `wicore` command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import WICORE, alive, children_of, process_group_members, wait_until, wicore, write_images
from wicore.embedded import EmbeddedRedis
from wicore.schemas import ResultLine

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-Pw-for-the-caption-tests"
IMAGES = 48


def caption_args(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["caption", str(folder), "-o", str(out), "--batch-size", "2", "--max-new-tokens", "8", *extra]


def start_caption(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([WICORE, *args], env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def interrupt_mid_run(caption: subprocess.Popen, out: Path, sig: int) -> tuple[list[int], int, str]:
    """Once the first result line is written: the run's children, their process group, and the
    stderr of the run after `sig` stopped it."""
    wait_until(lambda: line_count(out) > 0 or caption.poll() is not None, 240, 0.1, "a first result line")
    children = children_of(caption.pid)
    groups = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) for pid in children}
    assert caption.poll() is None and line_count(out) < IMAGES, "the signal lands mid-run"
    caption.send_signal(sig)
    _, stderr = caption.communicate(timeout=120)
    [group] = groups
    return children, group, stderr.decode()


def valid_lines(out: Path) -> list[ResultLine]:
    lines = [ResultLine.model_validate_json(line) for line in out.read_text().splitlines()]
    assert len({line.input for line in lines}) == len(lines), "each input once"
    return lines


def test_sigterm_mid_run_stops_every_child_and_a_rerun_finishes(tmp_path):
    write_images(tmp_path / "imgs", IMAGES)
    out, env = tmp_path / "out.jsonl", {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    caption = start_caption(caption_args(tmp_path / "imgs", out), env)
    children, group, stderr = interrupt_mid_run(caption, out, signal.SIGTERM)

    assert caption.returncode == 128 + signal.SIGTERM
    assert len(children) == 2, "the embedded redis-server and one worker"
    assert group not in (os.getpgid(0), caption.pid), "the children have a process group of their own"
    assert process_group_members(group) == [] and not any(alive(pid) for pid in children)
    done = len(valid_lines(out))
    [line] = stderr.strip().splitlines()
    assert line == f"error: stopped by SIGTERM; {done} inputs got their line in {out}; rerun to do the rest"

    rerun = wicore(*caption_args(tmp_path / "imgs", out), env=env)
    assert rerun.stderr.startswith(f"captioned {IMAGES - done} of {IMAGES - done} inputs (0 errors, {done} already")
    lines = valid_lines(out)
    assert len(lines) == IMAGES and all(line.status == "finished" for line in lines)


def test_sigint_with_an_external_redis_takes_the_runs_jobs_back(tmp_path):
    write_images(tmp_path / "imgs", IMAGES)
    out, cache = tmp_path / "out.jsonl", tmp_path / "cache"
    with EmbeddedRedis(password=PASSWORD) as server:
        env = {"XDG_CACHE_HOME": str(cache), "WICORE_REDIS_URL": server.url}
        caption = start_caption(caption_args(tmp_path / "imgs", out), env)
        children, group, stderr = interrupt_mid_run(caption, out, signal.SIGINT)

        assert caption.returncode == 128 + signal.SIGINT and len(children) == 1, "one worker, no redis-server"
        assert process_group_members(group) == [] and not alive(children[0])
        [line] = stderr.strip().splitlines()
        assert f"unstarted jobs of this run from Redis at redis://:***@127.0.0.1:{server.port}/0" in line
        status = json.loads(wicore("status", "--json", env=env).stdout)
        assert [(q["queued"], q["started"]) for q in status["queues"]] == [(0, 0)], "nothing left to run"

        rerun = wicore(*caption_args(tmp_path / "imgs", out), env=env)  # the removed jobs are submitted anew
        lines = valid_lines(out)
        assert len(lines) == IMAGES and all(line.status == "finished" for line in lines)
    logs = [p.read_text(errors="replace") for p in cache.rglob("*") if p.is_file()]
    assert logs and not any(PASSWORD in text for text in [stderr, rerun.stdout, rerun.stderr, *logs])
