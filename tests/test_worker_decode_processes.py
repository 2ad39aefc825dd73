"""A worker whose images are read, decoded and resized in decode processes (the fast engine takes
them resized) ends every job as one that decodes in threads: the same tokens, the same error
lines, blobs and paths alike."""

from __future__ import annotations

import pytest

from tests.fast_requests import one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import png_bytes, write_images
from wicore.engines import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.scheduler.policy import BatchPolicy
from wicore.schemas import GenerationParams
from wicore.worker.job_inputs import InputConfig
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4))


def run_all(redis_conn, engine, root, processes: int) -> tuple[dict, BatchingWorker]:
    """The same jobs on a fresh database: (job -> (token ids, error)), the worker."""
    redis_conn.flushdb()
    params = GenerationParams(max_new_tokens=4)
    blobs = Producer(redis_conn, model=MODEL)
    paths = Producer(redis_conn, model=MODEL, config=ProducerConfig(by_path=True))
    ids = blobs.submit_many(
        [Submission(png_bytes(i, (30 + 7 * i, 44 - 3 * i)), f"picture {i}", params=params) for i in range(4)]
        + [Submission(b"not an image at all", params=params)]
    )
    ids += paths.submit_many([Submission(p, f"file {i}", params=params) for i, p in enumerate(sorted(root.iterdir()))])
    ids += paths.submit_many([Submission(root.parent / "outside.png", params=params)])
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.0)
    inputs = InputConfig(allowed_roots=(root,), processes=processes)
    worker = BatchingWorker(redis_conn, engine, WorkerConfig(MODEL, policy=policy, inputs=inputs, burst=True))
    worker.run()
    ends = {o.job_id: o for o in blobs.wait(ids, timeout=60)}
    return [(list(ends[i].result.token_ids) if ends[i].result else None, ends[i].error) for i in ids], worker


def test_decode_processes_end_every_job_as_threads_do(redis_conn, engine, tmp_path):
    root = tmp_path / "allowed"
    write_images(root, 3)
    (tmp_path / "outside.png").write_bytes(png_bytes(99))
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n and then nothing")
    in_processes, worker = run_all(redis_conn, engine, root, processes=2)
    assert worker.inputs.pixels is not None, "the fast engine takes resized images: processes resize them"
    in_threads, worker = run_all(redis_conn, engine, root, processes=0)
    assert worker.inputs.pixels is None
    assert in_processes == in_threads
    errors = [error.split(":")[0] for _, error in in_processes if error]
    assert errors == ["ImageError", "ImageError", "ImageNotAllowed"], in_processes
    assert sum(tokens is not None for tokens, _ in in_processes) == 7


def test_no_decode_processes_for_an_engine_that_takes_decoded_images(redis_conn, tiny_model_dir):
    from wicore.engines.reference import ReferenceEngine

    reference = ReferenceEngine(EngineConfig(str(tiny_model_dir), max_batch_size=2))
    assert reference.pixel_spec() is None, "HF's processor resizes: it takes decoded images"
    worker = BatchingWorker(redis_conn, reference, WorkerConfig(MODEL, inputs=InputConfig(processes=2)))
    assert worker.inputs.pixels is None
    worker.inputs.close()
