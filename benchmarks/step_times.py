"""The engine's own step durations, kept by a StatsSink a benchmark hands the engine.

A step's duration is the engine's measure of it (StepStats.duration_s: the model call and
the KV moves, not the Python around it), so a benchmark picks the steps of one shape, for
example the pure decode steps of 32 sequences:

    steps = StepTimes()
    llm.engine.stats = steps
    llm.generate(prompts, params)
    durations = steps.durations(num_decode=32, num_prefill=0)
"""

from __future__ import annotations

from tokenserve.stats import StatsSink


class StepTimes(StatsSink):
    """(duration_s, decode tokens, prefill tokens) of every step since the last clear()."""

    def __init__(self):
        self.steps: list[tuple[float, int, int]] = []

    def on_step(self, stats) -> None:
        self.steps.append((stats.duration_s, stats.num_decode_tokens, stats.num_prefill_tokens))

    def clear(self) -> None:
        self.steps.clear()

    def durations(self, num_decode: int, num_prefill: int = 0) -> list[float]:
        """The durations of the steps that decoded exactly `num_decode` sequences and
        prefilled exactly `num_prefill` tokens."""
        return [d for d, decode, prefill in self.steps
                if decode == num_decode and prefill == num_prefill]
