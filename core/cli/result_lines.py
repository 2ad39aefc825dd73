"""Job outcomes as result lines (`ResultLine`, `wicore schema result`), for `wicore caption` and
`wicore result`: one wait for many jobs together, each line printed as its job ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from wicore.errors import ResultTimeout
from wicore.producer.outcome import Outcome
from wicore.producer.waiting import MISSING
from wicore.schemas import ResultLine

GONE = "no such job in Redis (never submitted, or its result expired)"


def line_of(outcome: Outcome, input: str | None) -> ResultLine:
    if outcome.result is not None:
        return ResultLine.of_result(outcome.result, input)
    if outcome.status == MISSING:
        return ResultLine(input=input, job_id=outcome.job_id, status="unknown", error=GONE)
    if outcome.error is not None:
        status = "canceled" if outcome.canceled else "failed"
        return ResultLine(input=input, job_id=outcome.job_id, status=status, error=outcome.error)
    return ResultLine(input=input, job_id=outcome.job_id, status="unfinished")


def error_line(input: str, error: str) -> ResultLine:
    """An input that failed before any job was made."""
    return ResultLine(input=input, job_id=None, status="failed", error=error)


def wait_lines(
    producer,
    inputs_by_job: dict[str, list[str | None]],
    timeout: float | None,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = 0.5,
) -> Iterator[ResultLine]:
    """A line per input as its job ends, in completion order; once `timeout` seconds have
    passed (all jobs together), an 'unfinished' line for each input still waiting."""
    pending = dict(inputs_by_job)
    try:
        for outcome in producer.wait(list(pending), timeout=timeout, poll_s=poll_s, on_poll=on_poll):
            for input in pending.pop(outcome.job_id, []):
                yield line_of(outcome, input)
    except ResultTimeout:
        for job_id, inputs in pending.items():
            for input in inputs:
                yield ResultLine(input=input, job_id=job_id, status="unfinished")
