"""Inputs -> jobs, for `wicore caption` and `wicore enqueue`: submitted in chunks as the inputs are
read; an input the producer cannot read (unreadable file, over the byte limit) is reported alone
and the rest go on."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TypeVar

from wicore.cli.input_paths import InputItem
from wicore.errors import JobInputError

CHUNK = 256
T = TypeVar("T")


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """`items` in lists of `size` (the last one shorter), read lazily."""
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def submit_items(
    producer,
    items: Iterable[InputItem],
    submission_for: Callable,
    on_error: Callable[[InputItem, str], None],
) -> Iterator[tuple[str, str]]:
    """(job id, input) per input submitted, chunk by chunk as each goes out (the same work given
    twice is one job). Items that already carry an error go to `on_error` unsubmitted."""
    for chunk in batched(items, CHUNK):
        for item in (i for i in chunk if i.error):
            on_error(item, item.error)
        good = [i for i in chunk if not i.error]
        try:
            ids = producer.submit_many([submission_for(i) for i in good])
        except JobInputError:  # one unreadable file: find it by submitting one by one
            ids = [_submit_one(producer, i, submission_for, on_error) for i in good]
        yield from ((job_id, item.input) for item, job_id in zip(good, ids) if job_id is not None)


def _submit_one(producer, item: InputItem, submission_for: Callable, on_error) -> str | None:
    try:
        return producer.submit_many([submission_for(item)])[0]
    except JobInputError as exc:
        on_error(item, f"{type(exc).__name__}: {exc}")
        return None
