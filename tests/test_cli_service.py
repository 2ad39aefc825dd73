"""The service path as the README tells a new user to run it, with default options, against a
password-protected redis-server: `wicore worker`, `wicore enqueue`, `wicore result`, `wicore
status`, all through the installed `wicore` command. The password never shows in any output
or log."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from redis import Redis

from tests.helpers import start_worker, stop, wait_until, wicore
from wicore.embedded import EmbeddedRedis
from wicore.schemas import ResultLine

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-Pw-for-the-service-tests"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "images"
# README: each example file is named after its true caption.
CAPTIONS = {
    "orange-circle-on-red.png": "an orange circle on a red background",
    "red-square-on-black.jpg": "a red square on a black background",
    "red-star-on-purple.png": "a red star on a purple background",
    "white-circle-on-black.png": "a white circle on a black background",
    "white-cross-on-red.jpg": "a white cross on a red background",
    "yellow-triangle-on-orange.jpg": "a yellow triangle on an orange background",
}


@pytest.fixture
def service(tmp_path):
    """A password-protected Redis and one default worker (the bundled model), as the README
    starts them; yields (env with WICORE_REDIS_URL, worker log)."""
    log = tmp_path / "worker.log"
    with EmbeddedRedis(password=PASSWORD) as server:
        env = {"WICORE_REDIS_URL": server.url, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        worker = start_worker(env=env, log=log)
        try:
            connection = Redis.from_url(server.url)
            wait_until(lambda: connection.smembers("rq:workers") or worker.poll() is not None, 120, what="worker")
            assert worker.poll() is None, log.read_text()
            yield env, log
        finally:
            assert stop(worker) == 0, log.read_text()[-3000:]


def outputs(*runs) -> str:
    return "".join(run.stdout + run.stderr for run in runs)


def test_readme_flow_with_default_options_captions_the_examples(tmp_path, service):
    env, log = service
    shutil.copytree(EXAMPLES, tmp_path / "images")
    enqueued = wicore("enqueue", str(tmp_path / "images"), env=env)
    pairs = [line.split("\t") for line in enqueued.stdout.splitlines()]
    assert sorted(Path(item).name for _, item in pairs) == sorted(CAPTIONS), "one `id<TAB>input` line per image"
    assert "warning" not in enqueued.stderr, "the default worker serves the default model"
    (tmp_path / "jobs.tsv").write_text(enqueued.stdout)

    results = wicore("result", "-", "--wait", "120", env=env, stdin=(tmp_path / "jobs.tsv").read_text())
    lines = [ResultLine.model_validate_json(line) for line in results.stdout.splitlines()]
    assert {Path(line.input).name: line.text for line in lines} == CAPTIONS
    assert all(line.status == "finished" and line.model == "democap" for line in lines)

    status = json.loads(wicore("status", "--json", env=env).stdout)
    [worker] = status["workers"]
    assert (worker["model"], worker["engine"], worker["device"]) == ("democap", "reference", "cpu")
    assert worker["state"] in ("idle", "busy") and worker["ok"] == len(CAPTIONS)
    assert all(queue["served"] and queue["model"] == "democap" for queue in status["queues"])
    table = wicore("status", env=env)
    assert "democap" in table.stdout and "reference" in table.stdout and "a live worker" in table.stdout

    worker_log = log.read_text()
    assert "INFO wicore.worker.batches: batch wicore.democap.normal." in worker_log
    assert "\r" not in worker_log and "\x1b[" not in worker_log, "no progress bars or colour codes in a log"
    assert PASSWORD not in outputs(enqueued, results, table) + log.read_text()


def test_jobs_for_a_model_no_worker_serves(tmp_path, service):
    """A warning at enqueue; status flags the queue; `result --wait` waits once for all its ids
    and prints each as it ends (the served job's line comes before the unserved one's)."""
    env, log = service
    image = tmp_path / "cat.png"
    image.write_bytes((EXAMPLES / "red-star-on-purple.png").read_bytes())
    unserved = wicore("enqueue", str(image), "--model-id", "tiny", env=env)
    assert "warning: no live worker serves model tiny (live workers serve: democap)" in unserved.stderr
    served = wicore("enqueue", str(image), env=env)
    assert served.stderr == ""
    (stuck, _), (ok, _) = (run.stdout.strip().split("\t") for run in (unserved, served))

    waited = wicore("result", stuck, ok, "--wait", "20", env=env, check=False)
    lines = [ResultLine.model_validate_json(line) for line in waited.stdout.splitlines()]
    assert [(line.job_id, line.status) for line in lines] == [(ok, "finished"), (stuck, "unfinished")]
    assert waited.returncode == 3 and lines[0].text == CAPTIONS["red-star-on-purple.png"]

    queues = {q["model"]: q for q in json.loads(wicore("status", "--json", env=env).stdout)["queues"]}
    assert queues["tiny"]["served"] is False and queues["tiny"]["queued"] == 1 and queues["democap"]["served"]
    assert "no live worker serves tiny" in wicore("status", env=env).stdout


def test_result_lines_have_one_shape_and_exit_codes(tmp_path, service):
    env, log = service
    (tmp_path / "bad.png").write_bytes(b"not a png")
    good = tmp_path / "good.png"
    good.write_bytes((EXAMPLES / "white-cross-on-red.jpg").read_bytes())
    ids = [wicore("enqueue", str(p), env=env).stdout.split("\t")[0] for p in (good, tmp_path / "bad.png")]
    run = wicore("result", *ids, "wc-unknown", "--wait", "60", env=env, check=False)
    lines = {line["job_id"]: line for line in map(json.loads, run.stdout.splitlines())}
    assert run.returncode == 1 and {len(line) for line in lines.values()} == {len(ResultLine.model_fields)}
    assert lines[ids[0]]["status"] == "finished" and lines[ids[0]]["error"] is None
    assert lines[ids[1]]["status"] == "failed" and lines[ids[1]]["error"].startswith("ImageError")
    assert lines["wc-unknown"]["status"] == "unknown" and "no such job" in lines["wc-unknown"]["error"]
    assert f"WARNING wicore.worker.batches: job {ids[1]} failed: ImageError" in log.read_text()
