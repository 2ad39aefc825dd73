"""Inputs -> jobs, for `wicore caption` and `wicore enqueue`: submitted in chunks; an input the
producer cannot read (unreadable file, over the byte limit) is reported alone and the rest go on."""

from __future__ import annotations

from collections.abc import Callable

from wicore.cli.input_paths import InputItem
from wicore.errors import JobInputError

CHUNK = 256


def submit_items(
    producer,
    items: list[InputItem],
    submission_for: Callable,
    on_error: Callable[[InputItem, str], None],
    by_job: dict[str, list[InputItem]] | None = None,
) -> dict[str, list[InputItem]]:
    """{job id: the inputs it answers} (the same work given twice is one job), filled in as
    chunks go out (`by_job`, when given, is filled: a caller stopped half-way knows what was
    submitted). Items that already carry an error go to `on_error` unsubmitted."""
    by_job = {} if by_job is None else by_job
    for item in (i for i in items if i.error):
        on_error(item, item.error)
    good = [i for i in items if not i.error]
    for begin in range(0, len(good), CHUNK):
        chunk = good[begin : begin + CHUNK]
        try:
            ids = producer.submit_many([submission_for(i) for i in chunk])
        except JobInputError:  # one unreadable file: find it by submitting one by one
            ids = [_submit_one(producer, i, submission_for, on_error) for i in chunk]
        for item, job_id in zip(chunk, ids):
            if job_id is not None:
                by_job.setdefault(job_id, []).append(item)
    return by_job


def _submit_one(producer, item: InputItem, submission_for: Callable, on_error) -> str | None:
    try:
        return producer.submit_many([submission_for(item)])[0]
    except JobInputError as exc:
        on_error(item, f"{type(exc).__name__}: {exc}")
        return None
