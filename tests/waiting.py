"""Waiting for what the router does on its own clock (shared by the test packages)."""

from __future__ import annotations

import time
from collections.abc import Callable


def settled(read: Callable[[], float], apart: float = 1.1, timeout: float = 10) -> float:
    """A gauge's reading once two readings ``apart`` seconds apart agree: the router refreshes
    its gauges each second, and one reading after a fixed sleep could miss the last refresh
    on a loaded machine (and then differ from a later reading of the same figure)."""
    deadline = time.monotonic() + timeout
    value = read()
    while True:
        time.sleep(apart)
        again = read()
        if again == value or time.monotonic() > deadline:
            return again
        value = again


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    """Whether ``predicate`` held within ``timeout`` seconds (checked every ``step``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
