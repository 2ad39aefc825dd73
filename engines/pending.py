"""`Pending`: a value that is made in a thread (a `Future`) or known at once, read through one
surface: `ready` (its value or its error is known), `failed`, `error`, `value`."""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    __slots__ = ("_future", "_value")

    def __init__(self, future: Future | None = None, value: T | None = None):
        self._future, self._value = future, value

    @classmethod
    def now(cls, value: T) -> Pending[T]:
        return cls(value=value)

    @property
    def ready(self) -> bool:
        return self._future is None or self._future.done()

    @property
    def error(self) -> BaseException | None:
        """What the thread raised (None while not ready, or when it succeeded)."""
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def value(self) -> T:
        """The value; blocks until ready, raises what a failed thread raised."""
        return self._future.result() if self._future is not None else self._value

    def wait(self, timeout: float) -> None:
        """Until ready or `timeout` seconds."""
        if self._future is not None:
            wait([self._future], timeout=timeout)
