"""rq-dashboard, mounted by `wicore dashboard`, reads wicore's JSON jobs: its JSON endpoints list
the bucket queues, a live worker, and the finished and failed jobs."""

from __future__ import annotations

import os

import pytest
from rq.job import Job

from tests.helpers import png_bytes
from wicore.cli.failures import ExitCode
from wicore.engines import EngineConfig
from wicore.engines.null import NullEngine
from wicore.producer import Producer, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.rq_bridge import RQWorkerRecord
from wicore.worker.worker_config import WorkerConfig

pytest.importorskip("rq_dashboard")


def test_dashboard_lists_queues_workers_and_jobs(redis_conn, redis_url):
    from rq.serializers import JSONSerializer

    from wicore.worker.dashboard import make_app

    producer = Producer(redis_conn, model="dash")
    ok = producer.submit(png_bytes(1), "fine")
    bad = producer.submit(b"not an image", "broken")
    engine = NullEngine(EngineConfig(model_dir="", max_batch_size=8))
    BatchingWorker(redis_conn, engine, WorkerConfig("dash", policy=BatchPolicy(max_queue_delay_s=0), burst=True)).run()
    live = RQWorkerRecord([], name="dash-worker", connection=redis_conn, serializer=JSONSerializer)
    live.register_birth()

    client = make_app(redis_url).test_client()
    queues = client.get("/0/data/queues.json").get_json()["queues"]
    [queue] = [q for q in queues if q["name"].startswith("wicore.dash.")]
    workers = client.get("/0/data/workers.json").get_json()["workers"]
    assert "dash-worker" in [w["name"] for w in workers]

    name = queue["name"]
    finished = client.get(f"/0/data/jobs/{name}/finished/8/asc/1.json").get_json()["jobs"]
    failed = client.get(f"/0/data/jobs/{name}/failed/8/asc/1.json").get_json()["jobs"]
    assert [j["id"] for j in finished] == [ok]
    assert [j["id"] for j in failed] == [bad]
    detail = client.get(f"/0/data/job/{bad}.json").get_json()
    assert "ImageError" in detail["exc_info"]


def test_dashboard_shows_a_batch_in_flight(redis_conn, redis_url):
    """Jobs a worker claimed in one batch show as started, with their queue's count and the
    worker's current job, as rq-dashboard reads RQ's own records."""
    from rq.serializers import JSONSerializer

    from wicore.scheduler.queues import BucketQueues
    from wicore.worker.dashboard import make_app
    from wicore.worker.rq_bridge import RQBridge

    ids = Producer(redis_conn, model="dash").submit_many([Submission(png_bytes(i), "x") for i in range(3)])
    record = RQWorkerRecord([], name="dash-batch", connection=redis_conn, serializer=JSONSerializer)
    record.register_birth()
    [name] = BucketQueues(redis_conn, "dash").names()
    claimed = {c.id for c in RQBridge(record).claim(name, 2)}

    client = make_app(redis_url).test_client()
    started = client.get(f"/0/data/jobs/{name}/started/8/asc/1.json").get_json()["jobs"]
    assert {j["id"] for j in started} == claimed and all(j["started_at"] for j in started)
    [queue] = [q for q in client.get("/0/data/queues.json").get_json()["queues"] if q["name"] == name]
    assert (queue["count"], queue["started_job_registry_count"]) == (1, 2)
    [worker] = [w for w in client.get("/0/data/workers.json").get_json()["workers"] if w["name"] == "dash-batch"]
    assert worker["state"] == "busy" and worker["current_job"]["job_id"] in claimed
    assert set(ids) - claimed == {
        j["id"] for j in client.get(f"/0/data/jobs/{name}/queued/8/asc/1.json").get_json()["jobs"]
    }


# -- the guards, on the real `wicore dashboard` process ---------------------------------------

REDIS_PASSWORD = "redis-Secret-4711"
DASH_USER, DASH_PASSWORD = "admin", "dash-Secret-0815"


class Planted:
    """Unpickling this creates `marker`: a stand-in for any code an attacker stores in Redis."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def guarded_redis():
    """An embedded redis-server that wants a password; yields (url with password, connection)."""
    from redis import Redis

    from wicore.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        Redis.from_url(server.url).config_set("requirepass", REDIS_PASSWORD)
        url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"
        connection = Redis.from_url(url)
        yield url, connection
        connection.close()


def plant_jobs(connection, marker: str) -> dict[str, str]:
    """Jobs in every state whose `meta` is a pickle that would create `marker`; one of them is
    the current job of a live worker (the workers view fetches it)."""
    import pickle

    from rq.serializers import JSONSerializer

    from wicore.worker.rq_bridge import Finished, RQBridge

    producer = Producer(connection, model="dash")
    ids = producer.submit_many([Submission(png_bytes(i), f"job {i}") for i in range(4)])
    queue_name = Job.fetch(ids[0], connection=connection).origin
    record = RQWorkerRecord([], name="dash-live", connection=connection, serializer=JSONSerializer)
    record.register_birth()
    bridge = RQBridge(record)
    finished, failed, started = bridge.claim(queue_name, 3)
    bridge.finish([Finished(finished, result={"text": "x"}), Finished(failed, error="ImageError: planted")])
    for job_id in ids:
        connection.hset(f"rq:job:{job_id}", "meta", pickle.dumps(Planted(marker)))
    return {"queued": ids[3], "finished": finished.id, "failed": failed.id, "started": started.id, "queue": queue_name}


def http(port: int, path: str, *, method: str = "GET", auth=(DASH_USER, DASH_PASSWORD), headers=None):
    """(status, body, headers) of one request to the dashboard."""
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=dict(headers or {}))
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(request, data=b"" if method == "POST" else None, timeout=10) as reply:
            return reply.status, reply.read().decode(errors="replace"), reply.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace"), error.headers


def read_paths(jobs: dict[str, str]) -> list[str]:
    q = jobs["queue"]
    registries = ["queued", "started", "finished", "failed", "deferred", "scheduled", "canceled"]
    paths = ["/", "/0/view", "/0/view/queues", "/0/view/workers", "/0/view/jobs"]
    paths += ["/0/data/queues.json", "/0/data/workers.json"]
    paths += [f"/0/view/jobs/{q}/{r}/8/asc/1" for r in registries]
    paths += [f"/0/data/jobs/{q}/{r}/8/asc/1.json" for r in registries]
    for state in ("queued", "finished", "failed", "started"):
        paths += [f"/0/view/job/{jobs[state]}", f"/0/data/job/{jobs[state]}.json"]
    return paths


def write_requests(jobs: dict[str, str]) -> list[str]:
    q = jobs["queue"]
    return [
        f"/job/{jobs['queued']}/delete",
        f"/job/{jobs['failed']}/requeue",
        f"/requeue/{q}",
        f"/queue/{q}/queued/empty",
        f"/queue/{q}/finished/empty",
        f"/queue/{q}/compact",
    ]


def redis_flags(url: str, form: str, folder) -> tuple[list[str], str]:
    """The flags giving the dashboard its Redis password in `form`, and how it prints the URL."""
    bare = url.replace(f":{REDIS_PASSWORD}@", "")
    if form == "userinfo":
        return ["--redis-url", url], url.replace(REDIS_PASSWORD, "***")
    if form == "query":
        return ["--redis-url", f"{bare}?password={REDIS_PASSWORD}"], f"{bare}?password=***"
    secret = folder / "redis-password"
    secret.write_text(REDIS_PASSWORD + "\n")
    return ["--redis-url", bare, "--redis-password-file", str(secret)], url.replace(REDIS_PASSWORD, "***")


@pytest.mark.faults
@pytest.mark.parametrize("form", ["userinfo", "query", "file"])
def test_dashboard_never_unpickles_guards_writes_and_hides_passwords(guarded_redis, tmp_path, form):
    import subprocess
    import sys

    from tests.helpers import stop, wait_for_port
    from wicore.embedded import free_port

    url, connection = guarded_redis
    marker = tmp_path / "pwned"
    jobs = plant_jobs(connection, str(marker))
    port = free_port()
    env = {**os.environ, "WICORE_DASHBOARD_AUTH": f"{DASH_USER}:{DASH_PASSWORD}", "WICORE_LOG_LEVEL": "INFO"}
    flags, shown = redis_flags(url, form, tmp_path)
    command = [sys.executable, "-m", "wicore.cli.main", "dashboard", *flags, "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    bodies = []
    try:
        wait_for_port(port, process=process)
        for path in read_paths(jobs):
            status, body, _ = http(port, path)
            bodies.append(body)
            assert status in (200, 500), f"GET {path}: {status}"
            assert http(port, path, auth=None)[0] == 401, f"GET {path} without the login"
            assert http(port, path, auth=(DASH_USER, "wrong"))[0] == 401
        for path in write_requests(jobs):
            assert http(port, path)[0] == 405, f"GET {path} is a write"
            assert http(port, path, method="POST")[0] == 403, f"POST {path} without the token"
            assert http(port, path, method="POST", headers={"X-CSRFToken": "guess"})[0] == 403
        assert connection.exists(f"rq:job:{jobs['queued']}"), "a refused write changed nothing"

        status, page, headers = http(port, "/0/view/queues")
        token = headers["Set-Cookie"].split("_csrf_token=")[1].split(";")[0]
        cookie = {"X-CSRFToken": token}
        foreign = {**cookie, "Origin": "http://evil.example"}
        assert http(port, f"/job/{jobs['queued']}/delete", method="POST", headers=foreign)[0] == 403
        for path in write_requests(jobs):
            status, body, _ = http(port, path, method="POST", headers=cookie)
            bodies.append(body)
            assert status == 200 and '"OK"' in body, f"POST {path} with the token: {status} {body}"
        assert not connection.exists(f"rq:job:{jobs['queued']}"), "the delete went through"
    finally:
        stop(process)
    output = process.stdout.read().decode(errors="replace")
    assert not marker.exists(), "the dashboard unpickled a job's meta"
    for secret in (REDIS_PASSWORD, DASH_PASSWORD):
        assert secret not in output and not any(secret in body for body in bodies)
    assert f"for {shown}" in output, output


@pytest.mark.faults
def test_dashboard_refuses_to_start_without_redis_in_one_line(guarded_redis):
    from tests.helpers import wicore
    from wicore.embedded import free_port

    url, _ = guarded_redis
    wrong = url.replace(REDIS_PASSWORD, "not-the-password")
    for bad_url, says in (
        (wrong, "refused the user name or password"),
        (f"redis://:pw@127.0.0.1:{free_port()}/0", "cannot reach"),
    ):
        result = wicore("dashboard", "--redis-url", bad_url, "--port", str(free_port()), check=False, timeout=60)
        output = result.stdout + result.stderr
        assert result.returncode == ExitCode.REDIS and says in output, output
        assert output.count("error:") == 1 and "Traceback" not in output  # one message (the console may wrap it)
        assert "not-the-password" not in output and ":pw@" not in output
    exposed = wicore("dashboard", "--redis-url", url, "--host", "0.0.0.0", check=False, timeout=60)
    assert exposed.returncode == ExitCode.USAGE and "--auth" in exposed.stderr
