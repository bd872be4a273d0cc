"""One bounded poll for every wait in the tests (no wall-clock bound is ever asserted: the deadline only keeps a
broken build from hanging the suite)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               message: str | Callable[[], str] = "condition not met in time", strict: bool = True) -> T:
    """Call ``predicate`` until it returns something truthy and return that; after ``timeout`` seconds an
    AssertionError with ``message`` (a string, or a callable for a message computed then: a log's tail), or with
    ``strict=False`` the last (falsy) value, for a caller whose own assertion follows. An exception from
    ``predicate`` propagates: a check that must fail at once (a process exited) raises there."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            if not strict:
                return value
            raise AssertionError(message() if callable(message) else message)
        time.sleep(interval)
