"""Inputs -> jobs, for `wicore caption` and `wicore enqueue`: submitted in chunks as the inputs are
read; an input the producer cannot read (unreadable file, over the byte limit) is reported alone
and the rest go on.

Flow control lives here. A bulk submitter cuts its inputs into windows (`windows`): each window
holds at most half the run's job limit and half its byte limit (the image bytes that travel as
blobs), and it keeps at most two windows unfinished in Redis: the next goes out once the oldest
has ended. So Redis holds at most `window_jobs` jobs and `window_bytes` of their images, whatever
the dataset's size, while the second window keeps the workers busy as the first drains. A lane at
its admission cap (`QueueFull`) makes the submitter wait the time the refusal names and retry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TypeVar

from wicore.cli.input_paths import InputItem
from wicore.errors import JobInputError, QueueFull

CHUNK = 256
WINDOWS_IN_FLIGHT = 2  # one draining while the next keeps the workers busy
MAX_FULL_WAIT_S = 5.0  # longest single wait on a full lane before trying again
T = TypeVar("T")


@dataclass(frozen=True)
class FlowLimits:
    """What one bulk run may hold in Redis at once: unfinished jobs, and their image bytes (0: no
    byte bound). `by_path`: images travel as paths, so they cost Redis no bytes."""

    jobs: int
    bytes: int = 0
    by_path: bool = False

    def window_jobs(self) -> int:
        return max(1, self.jobs // WINDOWS_IN_FLIGHT)

    def window_bytes(self) -> int:
        return self.bytes // WINDOWS_IN_FLIGHT


def blob_bytes(item: InputItem, by_path: bool) -> int:
    """The bytes the item's images put in Redis: its data, or its files unless sent by path (URLs
    are fetched by the workers and cost Redis nothing)."""
    if item.data is not None:
        return len(item.data)
    if by_path or item.error:
        return 0
    return sum(_file_size(path) for path in item.files)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # unreadable: the producer reports it, and it stores nothing


def windows(items: Iterable[InputItem], limits: FlowLimits) -> Iterator[list[InputItem]]:
    """`items` cut into windows of at most `limits.window_jobs()` items and (but for a single item
    over it) `limits.window_bytes()` blob bytes, read lazily."""
    window: list[InputItem] = []
    held = 0
    byte_cap = limits.window_bytes()
    for item in items:
        size = blob_bytes(item, limits.by_path)
        if window and (len(window) >= limits.window_jobs() or (byte_cap and held + size > byte_cap)):
            yield window
            window, held = [], 0
        window.append(item)
        held += size
    if window:
        yield window


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
            ids = admitted(partial(producer.submit_many, [submission_for(i) for i in good]))
        except JobInputError:  # one unreadable file: find it by submitting one by one
            ids = [admitted(partial(_submit_one, producer, i, submission_for, on_error)) for i in good]
        yield from ((job_id, item.input) for item, job_id in zip(good, ids) if job_id is not None)


def _submit_one(producer, item: InputItem, submission_for: Callable, on_error) -> str | None:
    try:
        return producer.submit_many([submission_for(item)])[0]
    except JobInputError as exc:
        on_error(item, f"{type(exc).__name__}: {exc}")
        return None


def admitted(submit: Callable[[], T], on_wait: Callable[[QueueFull], None] | None = None) -> T:
    """`submit()`, again after the wait a `QueueFull` names (at most MAX_FULL_WAIT_S at a time)
    until the lane takes it; the same work submitted again is the same jobs, so a retry of a
    chunk that a sharded Redis took in part adds nothing twice."""
    while True:
        try:
            return submit()
        except QueueFull as full:
            (on_wait or _say_full)(full)
            time.sleep(min(MAX_FULL_WAIT_S, full.retry_after_s))


def _say_full(full: QueueFull) -> None:
    from wicore.cli.common import console

    console.print(f"waiting: {full}", markup=False)
