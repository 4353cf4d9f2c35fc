"""The background worker: calls run on a thread of its own, below the caller's priority
(Linux), and its errors reach the caller."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tokenserve.engine import background
from tokenserve.engine.background import BackgroundWorker


def _where() -> tuple[int, int]:
    native = threading.get_native_id()
    return native, os.getpriority(os.PRIO_PROCESS, native)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_calls_run_on_one_lower_priority_thread():
    worker = BackgroundWorker("test", niceness=3)
    caller, caller_nice = _where()
    thread, nice = worker.run(_where)
    assert thread != caller and nice == min(19, caller_nice + 3)
    assert worker.run(_where) == (thread, nice)  # the same thread, still lowered
    assert _where() == (caller, caller_nice)     # the caller's own priority untouched


def test_errors_reach_the_caller():
    def fail():
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        BackgroundWorker("test").run(fail)


def test_a_call_runs_with_a_short_switch_interval_and_the_callers_comes_back():
    before = sys.getswitchinterval()
    during = BackgroundWorker("test").run(sys.getswitchinterval)
    assert during == pytest.approx(min(before, background.SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == before
