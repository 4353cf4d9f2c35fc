"""A mixture of experts' load per step, from the runner's running totals (plain NumPy).

The step counts the rows routed to each expert of each layer into a variable that only grows
(engine/step/moe.py); each engine step takes the difference from the last read, so the
step's stats carry that step's load (StepStats.expert_tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class ExpertLoadDelta:
    """This step's rows per expert from a reader of running totals.

    Args:
        read: () -> int64 [layers, experts] totals, or None for a model without experts
            (ModelRunner.expert_load); None itself for runners that have no such reader.
    """

    def __init__(self, read: Callable[[], np.ndarray | None] | None):
        self.read = read
        self.last: np.ndarray | None = None

    def take(self) -> tuple[tuple[int, ...], ...]:
        """[layer][expert] rows since the last call (since the start, the first time); ()
        without experts."""
        totals = self.read() if self.read is not None else None
        if totals is None:
            return ()
        delta = totals if self.last is None else totals - self.last
        self.last = totals
        return tuple(tuple(row) for row in delta.tolist())
