"""The command line as users run it: real subprocesses, a real redis-server."""

from __future__ import annotations

import json
import re

import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from tests.helpers import kill_holding_pid, start_worker, stop, wait_until, wicore, write_images
from wicore.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow


@pytest.fixture
def server():
    with EmbeddedRedis() as s:
        yield s


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_ids(enqueued) -> list[str]:
    """The ids of `wicore enqueue`'s `id<TAB>input` lines."""
    return [line.split("\t")[0] for line in enqueued.stdout.splitlines()]


def test_caption_folder_with_broken_files_then_resume(tmp_path):
    folder = tmp_path / "photos"
    write_images(folder / "nested", 5)
    (folder / "truncated.png").write_bytes((folder / "nested" / "img0000.png").read_bytes()[:60])
    (folder / "notes.jpg").write_text("this is not a jpeg")
    (folder / "readme.txt").write_text("not an image type: gets an error line too")
    (folder / ".hidden.png").write_text("hidden files are not inputs")
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ["caption", str(folder), "-o", str(out), "--max-new-tokens", "4"]

    first = wicore(*args, env=env, check=False)
    assert first.returncode == 1, "some inputs failed"
    lines = read_lines(out)
    by_input = {line["input"]: line for line in lines}
    bad_names = ("truncated.png", "notes.jpg", "readme.txt")
    assert len(lines) == 8 and set(by_input) == {str(folder / "nested" / f"img000{i}.png") for i in range(5)} | {
        str(folder / name) for name in bad_names
    }
    for name in bad_names[:2]:
        bad = by_input[str(folder / name)]
        assert bad["text"] is None and bad["status"] == "failed" and bad["error"].startswith("ImageError")
    assert (
        by_input[str(folder / "readme.txt")]["error"].startswith("InputError: ")
        and "not an image file" in (by_input[str(folder / "readme.txt")]["error"])
    )
    for i in range(5):
        good = by_input[str(folder / "nested" / f"img000{i}.png")]
        assert isinstance(good["text"], str) and good["error"] is None and good["output_tokens"] == 4
    assert first.stderr.startswith("captioned 5 of 8 inputs (3 errors, 0 already done)")
    assert len(first.stderr.strip().splitlines()) == 1, "one summary line: no bar, no wrapping, in a pipe"
    seconds, rate = map(
        float, re.search(r" in ([\d.]+)s, ([\d.]+) images/s once the workers were ready", first.stderr).groups()
    )
    assert rate > 7 / seconds, "the rate counts from the first worker ready, not from the start (7 jobs ran)"
    [log_dir] = (tmp_path / "cache" / "wicore" / "logs").iterdir()
    assert first.stderr.strip().endswith(f"worker logs: {log_dir}") and [p.suffix for p in log_dir.iterdir()] == [
        ".log"
    ]

    again = wicore(*args, env=env, check=False)
    assert again.returncode == 1 and again.stderr.startswith("captioned 0 of 3 inputs (3 errors, 5 already done)")
    assert sorted(line["input"] for line in read_lines(out)) == sorted(by_input), "retried errors keep one line each"
    skipped = wicore(*args, "--skip-errors", env=env)
    assert "nothing to do: all 8 inputs already have a line" in skipped.stderr

    write_images(folder / "nested", 1, start=5)  # one new image: only it is captioned
    wicore(*args, "--skip-errors", env=env)
    lines = read_lines(out)
    assert len(lines) == 9 and lines[-1]["input"].endswith("img0005.png")


def test_worker_enqueue_result_three_processes(tmp_path, server, tiny_model_dir):
    images = write_images(tmp_path / "imgs", 200)
    url = server.url
    worker = start_worker(
        "--redis-url", url, "--model", str(tiny_model_dir), "--batch-size", "16", log=tmp_path / "w.log"
    )
    try:
        enqueued = wicore("enqueue", str(tmp_path / "imgs"), "--redis-url", url, "--model-id", "tiny",
                          "--max-new-tokens", "3")  # fmt: skip
        ids = job_ids(enqueued)
        assert len(ids) == 200 == len(set(ids)) == len(images)
        results = wicore("result", *ids, "--wait", "240", "--redis-url", url, timeout=600)
        lines = [json.loads(line) for line in results.stdout.splitlines()]
        assert sorted(line["job_id"] for line in lines) == sorted(ids)
        assert all(line.get("text") is not None and line["output_tokens"] == 3 for line in lines)
    finally:
        assert stop(worker) == 0, (tmp_path / "w.log").read_text()[-2000:]
    connection = Redis.from_url(url)
    assert all(connection.xlen(f"rq:results:{job_id}") == 1 for job_id in ids), "each job ran exactly once"


def test_result_exit_codes(tmp_path, server, tiny_model_dir):
    (tmp_path / "bad.png").write_bytes(b"garbage")
    url = server.url
    [job_id] = job_ids(wicore("enqueue", str(tmp_path / "bad.png"), "--redis-url", url, "--model-id", "tiny"))
    unfinished = wicore("result", job_id, "--redis-url", url, check=False)
    assert unfinished.returncode == 3
    stacks = tmp_path / "stacks.json"  # the loop thread sampled, its report written at exit
    worker = start_worker("--redis-url", url, "--model", str(tiny_model_dir), "--burst",
                          env={"WICORE_SAMPLE_STACKS": str(stacks)})  # fmt: skip
    assert worker.wait(timeout=120) == 0
    report = json.loads(stacks.read_text())
    rows = report["innermost"]  # each share rounded to 4 decimals: their sum within half a unit a row of 1
    assert report["samples"] > 0 and 0 < sum(share for _, share in rows) <= 1 + 0.00005 * len(rows)
    inclusive = dict(report["inclusive"])
    assert inclusive["run_sampled (daemons.py)"] == 1.0, "every sample is of the thread that runs the loop"
    assert inclusive["run (loop.py)"] > 0.5, "most inside BatchingWorker.run (a few at its edges, on a loaded machine)"
    connection = Redis.from_url(url)
    [published] = [json.loads(connection.get(key)) for key in connection.scan_iter("wicore:stats:*")]
    assert published["gc_full_collections"] >= 0 and published["gc_full_pause_max_s"] >= 0  # after gc.freeze
    failed = wicore("result", job_id, "--wait", "5", "--redis-url", url, check=False)
    assert failed.returncode == 1 and json.loads(failed.stdout)["error"].startswith("ImageError")
    unknown = wicore("result", "wc-nope", "--redis-url", url, check=False)
    assert unknown.returncode == 1 and json.loads(unknown.stdout)["status"] == "unknown"
    status = json.loads(wicore("status", "--json", "--redis-url", url).stdout)
    assert [q["failed"] for q in status["queues"]] == [1]


def test_a_canceled_job_reads_canceled_not_failed(tmp_path, server):
    write_images(tmp_path / "imgs", 1)
    url = server.url
    [job_id] = job_ids(wicore("enqueue", str(tmp_path / "imgs"), "--redis-url", url, "--model-id", "tiny"))
    canceled = wicore("cancel", job_id, "--redis-url", url)
    assert json.loads(canceled.stdout)["status"] == "canceled"
    read = wicore("result", job_id, "--redis-url", url, check=False)
    line = json.loads(read.stdout)
    assert (line["status"], read.returncode) == ("canceled", 1), "no result: exit 1, like a failed job"
    assert line["error"].startswith("JobCanceled") and line["text"] is None


def test_kill_9_mid_batch_then_new_worker_finishes_every_job_once(tmp_path, server, tiny_model_dir):
    write_images(tmp_path / "imgs", 24)
    url = server.url
    env = {"WICORE_LIVENESS_TTL_S": "2"}
    args = ["--redis-url", url, "--model", str(tiny_model_dir), "--batch-size", "8"]
    ids = job_ids(wicore("enqueue", str(tmp_path / "imgs"), "--redis-url", url, "--model-id", "tiny",
                         "--max-new-tokens", "48"))  # fmt: skip
    connection = Redis.from_url(url)
    queue_name = Job.fetch(ids[0], connection=connection).origin
    doomed = start_worker(*args, env=env, log=tmp_path / "doomed.log")
    wait_until(lambda: StartedJobRegistry(queue_name, connection=connection).count > 0, 120, what="a started batch")
    # the kill lands in the middle of a batch
    kill_holding_pid(doomed.pid, StartedJobRegistry(queue_name, connection=connection).get_job_ids)
    doomed.wait(timeout=60)

    survivor = start_worker(*args, env=env, log=tmp_path / "survivor.log")
    try:
        statuses = lambda: [Job.fetch(i, connection=connection).get_status() for i in ids]  # noqa: E731
        wait_until(lambda: all(s == JobStatus.FINISHED for s in statuses()), 180, 0.5, "every job to finish")
    finally:
        stop(survivor)
    assert all(connection.xlen(f"rq:results:{i}") == 1 for i in ids), "no job finished twice"
    assert StartedJobRegistry(queue_name, connection=connection).count == 0
    assert connection.llen("rq:queue:" + queue_name) == 0


def test_caption_fast_and_reference_engines_write_identical_texts(tmp_path, tiny_model_dir):
    """The CLI parity check of the fast engine: same inputs, both engines, same `text` lines."""
    folder = tmp_path / "imgs"
    write_images(folder, 12, start=300)
    texts = {}
    for engine in ("reference", "fast"):
        out = tmp_path / f"{engine}.jsonl"
        wicore("caption", str(folder), "-o", str(out), "--model", str(tiny_model_dir), "--engine", engine,
               "--max-new-tokens", "12", "--batch-size", "4")  # fmt: skip
        texts[engine] = {line["input"]: line["text"] for line in read_lines(out)}
        assert all(line["engine"] == engine for line in read_lines(out))
    assert len(texts["fast"]) == 12 and texts["fast"] == texts["reference"]


def test_the_fast_worker_reports_its_time_to_ready(tmp_path, server, tiny_model_dir):
    log = tmp_path / "worker.log"
    worker = start_worker("--redis-url", server.url, "--model", str(tiny_model_dir), "--engine", "fast", "--burst",
                          log=log)  # fmt: skip
    assert worker.wait(timeout=120) == 0
    text = log.read_text()
    assert "weights loaded: " in text and "peak during load not measured on the CPU" in text
    assert "engine ready: load " in text and ", ready in " in text  # the INFO log's phases; the serving line
    connection = Redis.from_url(server.url)
    [published] = [json.loads(connection.get(key)) for key in connection.scan_iter("wicore:stats:*")]
    assert published["ready_s"] >= published["load_s"] > 0 and published["weight_bytes"] > 0
