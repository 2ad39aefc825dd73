"""The function every wicore job names. wicore's batching worker never calls it (it runs whole
batches); it exists so that a plain RQ worker on the same queues still does the right thing,
one job at a time, with the model and settings of `WICORE_*`:

    rq worker --serializer rq.serializers.JSONSerializer wicore.tiny.normal.c1.p64.n64
"""

from __future__ import annotations

from functools import cache

from rq import get_current_job

from wicore.errors import EngineError, JobInputError
from wicore.schemas import CaptionJob, Timings
from wicore.worker.results import caption_result


@cache
def _engine():
    from wicore.config import load_settings
    from wicore.models import model_dir_and_id
    from wicore.worker.factory import build_engine

    settings = load_settings()
    model_dir, model_id = model_dir_and_id(settings)
    return build_engine(settings, model_dir), model_id, settings


def caption(payload: dict) -> dict:
    from wicore.ops.image_decode import ImageLimits
    from wicore.worker.job_inputs import InputConfig, InputLoader

    engine, model_id, settings = _engine()
    job = get_current_job()
    request_job = CaptionJob.model_validate(payload)
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels, settings.decode_budget_bytes)
    config = InputConfig(
        tuple(settings.allowed_roots), limits, threads=1, max_images_per_request=settings.max_images_per_request
    )
    loader = InputLoader(job.connection, config, fit=engine.image_size())
    [loaded] = loader.load([(job.id, request_job)])
    loader.close()
    if loaded.error:
        raise JobInputError(loaded.error)
    [done] = engine.generate([loaded.request])
    if not done.ok:
        raise (JobInputError if done.input_error else EngineError)(done.error)
    timings = Timings(queued_s=0.0, preprocess_s=loaded.preprocess_s, engine_s=done.engine_s, total_s=0.0)
    result = caption_result(job.id, done, timings, worker=job.worker_name or "", engine=engine.name, model=model_id)
    return result.model_dump(mode="json")
