"""An engine completion as the job's result record (what producers read back)."""

from __future__ import annotations

from wicore.engines.base import Completion
from wicore.schemas import CaptionResult, Timings


def caption_result(completion: Completion, timings: Timings, *, worker: str, engine: str, model: str) -> CaptionResult:
    return CaptionResult(
        job_id=completion.id,
        text=completion.text or "",
        finish_reason=completion.finish_reason or "length",
        prompt_tokens=completion.prompt_tokens,
        output_tokens=len(completion.token_ids),
        token_ids=tuple(completion.token_ids),
        timings=timings,
        worker=worker,
        engine=engine,
        model=model,
    )
