"""A job's end as a producer sees it: a result, an error message, or still running."""

from __future__ import annotations

from dataclasses import dataclass

from rq.results import Result

from wicore.schemas import CaptionResult


@dataclass(frozen=True)
class Outcome:
    job_id: str
    status: str  # RQ's job status: queued, started, finished, failed, ...
    result: CaptionResult | None = None
    error: str | None = None  # one line for people; the full text is in RQ's failed registry

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def canceled(self) -> bool:
        return self.status == CANCELED_STATUS


CANCELED_STATUS = "canceled"  # RQ's JobStatus.CANCELED
CANCELED_MESSAGE = "JobCanceled: canceled on request before it ended"


def error_line(exc_string: str | None) -> str:
    """The last non-empty line of a traceback, or the message itself."""
    lines = [line for line in (exc_string or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "failed (no message)"


def outcome_of(job_id: str, status, result: Result | None) -> Outcome:
    status_text = getattr(status, "value", status) or "unknown"
    if status_text == CANCELED_STATUS:  # a result written in a race with the cancel does not count
        return Outcome(job_id, status_text, error=CANCELED_MESSAGE)
    if result is None:
        return Outcome(job_id, status_text)
    if result.type == Result.Type.SUCCESSFUL:
        return Outcome(job_id, status_text, result=CaptionResult.model_validate(result.return_value))
    if result.type == Result.Type.RETRIED:
        return Outcome(job_id, status_text)
    return Outcome(job_id, status_text, error=error_line(result.exc_string))
