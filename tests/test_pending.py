"""`Pending`: a value made in a thread or known at once, read the same way."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from wicore.engines.pending import Pending


def test_a_known_value_is_ready():
    known = Pending.now([1, 2])
    assert known.ready and not known.failed and known.error is None and known.value == [1, 2]
    known.wait(0)  # returns at once


def test_a_future_is_ready_once_done():
    future = Future()
    pending = Pending(future)
    assert not pending.ready and not pending.failed and pending.error is None
    pending.wait(0.01)
    future.set_result("pixels")
    assert pending.ready and pending.value == "pixels" and not pending.failed


def test_a_failed_future_says_why_and_raises_on_value():
    future = Future()
    pending = Pending(future)
    future.set_exception(ValueError("not an image"))
    assert pending.ready and pending.failed and str(pending.error) == "not an image"
    with pytest.raises(ValueError, match="not an image"):
        _ = pending.value
