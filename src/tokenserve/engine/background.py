"""Work that should give way to the engine's step: one thread of its own at a lower
scheduling priority (plain Python, no TF).

A decode step keeps both of a small machine's cores busy (the op's thread and its helper);
checking a new adapter (read, parse, lay out: tens to hundreds of milliseconds of NumPy)
on an ordinary thread takes one of them for as long, and the streams' next token waits on
it. On this thread, niced, the kernel's scheduler runs it mostly in the step's gaps. The
thread keeps its priority for good: lowering it is always allowed, raising it back is not
(without CAP_SYS_NICE), so it is never done on a borrowed thread.

The cores are half of it, the GIL the other half: the step's own Python (scheduling, the
sampled tokens) takes the GIL back a few times a step, and while this thread runs Python
each take waits up to the interpreter's switch interval (5 ms by default; longer when the
niced thread holding it is off its core). So while a call runs here the switch interval is
SWITCH_INTERVAL_S, and the caller's comes back when no call runs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

NICENESS = 5
"""How much lower than the engine's the thread's priority is (Linux nice: CFS weight 335
against 1,024, about a quarter of a core while the step wants both; at 10, a tenth, a
rank-16 SmolLM2 adapter's check took about 1 s under load, over the live load's budget)."""

SWITCH_INTERVAL_S = 0.0005
"""The interpreter's switch interval while a background call runs: about the longest the
engine's thread waits for the GIL that the call's Python holds (None: left alone)."""


class _ShortSwitch:
    """The switch interval shortened while any background call runs (workers may overlap:
    the first call in shortens it, the last one out puts the interval before it back)."""

    _lock = threading.Lock()
    _running = 0
    _before = 0.0

    @classmethod
    def run(cls, fn: Callable[..., T], *args) -> T:
        short = SWITCH_INTERVAL_S
        if short is None:
            return fn(*args)
        with cls._lock:
            if cls._running == 0:
                cls._before = sys.getswitchinterval()
                sys.setswitchinterval(min(short, cls._before))
            cls._running += 1
        try:
            return fn(*args)
        finally:
            with cls._lock:
                cls._running -= 1
                if cls._running == 0:
                    sys.setswitchinterval(cls._before)


def _lower_priority(niceness: int) -> None:
    # Linux: PRIO_PROCESS with a thread id sets that thread's nice value alone
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness))
    except (AttributeError, OSError) as error:  # not Linux, or refused: ordinary priority
        log.debug("background thread keeps its priority: %s", error)


class BackgroundWorker:
    """Runs calls one at a time on a daemon thread of lower priority (made at first use).

    Example:
        >>> worker = BackgroundWorker("lora-check")
        >>> worker.run(sum, [1, 2])   # blocks the caller until done; raises what fn raises
        3
    """

    def __init__(self, name: str, niceness: int = NICENESS):
        self.name, self.niceness = name, niceness
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., T], *args) -> T:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix=f"tokenserve-{self.name}",
                    initializer=_lower_priority, initargs=(self.niceness,))
        return self._executor.submit(_ShortSwitch.run, fn, *args).result()
