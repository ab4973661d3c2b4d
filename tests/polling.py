"""Polling with a deadline, for tests that wait on other processes or threads (never fixed sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.02
) -> T:
    """Call predicate until it returns a truthy value, and return that value; AssertionError naming
    `what` once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
