"""Waiting on a condition with a deadline, instead of a fixed sleep."""

from __future__ import annotations

import time


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Polls `condition()` until true or `timeout_s` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(0.01)
    return True
