"""An engine completion as the job's result record (what producers read back)."""

from __future__ import annotations

import time

from wicore.engines.base import Completion
from wicore.schemas import CaptionResult, Choice, Timings


def job_timings(completion: Completion, submitted: float, started: float, preprocess_s: float) -> Timings:
    """A finished job's split, on the producer's clock (unix seconds) up to now."""
    total_s = max(0.0, time.time() - submitted)
    first = completion.first_token_s
    return Timings(
        queued_s=max(0.0, started - submitted),
        preprocess_s=preprocess_s,
        engine_s=completion.engine_s,
        total_s=total_s,
        # the engine's clock is not the producer's: count back from now by the time since the first token
        first_token_s=None if first is None else max(0.0, total_s - (completion.engine_s - first)),
    )


def caption_result(
    job_id: str, completion: Completion, timings: Timings, *, worker: str, engine: str, model: str
) -> CaptionResult:
    samples = completion.samples or [completion]
    return CaptionResult(
        job_id=job_id,
        text=completion.text or "",
        finish_reason=completion.finish_reason or "length",
        prompt_tokens=completion.prompt_tokens,
        output_tokens=sum(len(s.token_ids) for s in samples),
        token_ids=tuple(completion.token_ids),
        timings=timings,
        worker=worker,
        engine=engine,
        model=model,
        logprobs=None if completion.logprobs is None else tuple(completion.logprobs),
        choices=tuple(choice(i, s) for i, s in enumerate(completion.samples)),
    )


def choice(index: int, sample: Completion) -> Choice:
    """Sample `index` of a request's n (n > 1)."""
    return Choice(
        index=index,
        text=sample.text or "",
        finish_reason=sample.finish_reason or "length",
        token_ids=tuple(sample.token_ids),
        logprobs=None if sample.logprobs is None else tuple(sample.logprobs),
    )
