"""A corpus of more than a thousand malformed inputs (tests/fault_corpus.py) against one real
worker process (the tiny Gemma-3 on the reference engine): every input ends with a clear
per-job error or a correct result, good jobs mixed among them all succeed, and the worker
never dies."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from redis import Redis
from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from tests.fault_corpus import DEAD, REFUSED, RESULT, Corpus
from tests.fault_rig import Workers, wait_all_ended
from wicore import keys
from wicore.embedded import EmbeddedRedis

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]  # real outages and restarts: minutes on a loaded machine

CLEAR_REFUSALS = ("ValidationError", "ImageError", "ImageTooLarge")


def test_every_malformed_input_ends_clearly_and_the_worker_lives(tmp_path, tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--model-id", "corpus", "--engine", "reference", "--batch-size", "8"]
    args += ["--max-queue-delay-ms", "0", "--allow-root", str(tmp_path / "corpus" / "allowed")]
    with (
        EmbeddedRedis() as server,
        Workers(server.url, tmp_path / "logs", args, {"WICORE_LOG_LEVEL": "INFO"}) as workers,
    ):
        connection = Redis.from_url(server.url)
        workers.start("corpus-worker")
        planted = Corpus(connection, tmp_path / "corpus").build()  # the worker serves while it is planted
        jobs = [p for p in planted if p.job_id and DEAD not in p.expect]
        wait_all_ended(connection, [p.job_id for p in jobs], timeout=600)
        dead_letters = [fields for _, fields in connection.xrange(keys.DEAD_LETTER)]
        ends = {p.job_id: end_of(connection, p.job_id) for p in jobs}
        assert workers.alive() == ["corpus-worker"], workers.log("corpus-worker")[-3000:]
        assert "Traceback" not in workers.log("corpus-worker")
        assert workers.stop_all() == {"corpus-worker": 0}

    table: dict[str, Counter] = defaultdict(Counter)
    wrong = []
    for p in planted:
        end, message = (REFUSED, p.refusal) if p.job_id is None else (DEAD, "") if DEAD in p.expect else ends[p.job_id]
        table[p.kind][end] += 1
        if end not in p.expect or (end == REFUSED and not p.refusal.startswith(CLEAR_REFUSALS)):
            wrong.append(f"{p.kind} {p.job_id}: {end} ({message})"[:300])
    assert not wrong, f"{len(wrong)} inputs ended unexpectedly:\n" + "\n".join(wrong[:40])
    print(f"\nmalformed-input corpus: {len(planted)} inputs")
    for kind, by_end in sorted(table.items()):
        print(f"  {kind:26} {sum(by_end.values()):5}  " + ", ".join(f"{e} {n}" for e, n in sorted(by_end.items())))
    assert len(planted) >= 1000
    assert len(dead_letters) == sum(1 for p in planted if DEAD in p.expect)
    assert all(f[b"reason"] for f in dead_letters)
    assert table["good"][RESULT] == sum(table["good"].values()) >= 50


def end_of(connection: Redis, job_id: str) -> tuple[str, str]:
    """("result", "") or (the error class a failed job's message starts with, the message)."""
    if connection.hget(f"rq:job:{job_id}", "status") == b"finished":
        return RESULT, ""
    job = Job(job_id, connection=connection, serializer=JSONSerializer)
    latest = Result.fetch_latest(job, serializer=JSONSerializer)
    message = latest.exc_string if latest and latest.exc_string else "no message"
    return message.split(":", 1)[0], message
