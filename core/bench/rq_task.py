"""The job function plain RQ runs in `wicore bench queue`: the same per-job work the batching
worker does around the null engine (validate the payload, fetch and decode the image, build
the result), one job at a time."""

from __future__ import annotations

import hashlib

from rq import get_current_job

from wicore import keys
from wicore.ops.image_decode import decode_image
from wicore.schemas import CaptionJob, CaptionResult, Timings


def null_caption(payload: dict) -> dict:
    job = get_current_job()
    caption_job = CaptionJob.model_validate(payload)
    data = job.connection.get(keys.blob(caption_job.images[0].sha256))
    if data is None or hashlib.sha256(data).hexdigest() != caption_job.images[0].sha256:
        raise ValueError("image blob missing or changed")
    decode_image(data)
    result = CaptionResult(
        job_id=job.id, text="", finish_reason="length", prompt_tokens=0, output_tokens=0, token_ids=(),
        timings=Timings(queued_s=0.0, preprocess_s=0.0, engine_s=0.0, total_s=0.0),
        worker=job.worker_name or "", engine="null", model="bench-null-rq",
    )  # fmt: skip
    return result.model_dump(mode="json")
