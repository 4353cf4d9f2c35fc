"""One StatsSink that forwards to several (Prometheus, traces, TensorBoard ...).

The engine and each frontend take a single `stats` sink; this lets one stream of stats feed
every backend. A failing backend is logged and skipped, never raised into the engine loop.

Example:
    >>> sink = FanOutSink(LLMMetrics(registry), RequestTracer(provider), tensorboard_writer)
    >>> AsyncEngine.from_model_dir(path, config, stats=sink)        # doctest: +SKIP
"""

from __future__ import annotations

import logging

from tokenserve.stats import (RejectionStats, RequestStats, SchedulerStats, StatsSink,
                              StepStats)

log = logging.getLogger(__name__)


class FanOutSink(StatsSink):
    """Forwards each stat to every sink given (None entries are dropped, so optional
    backends can be passed as they are)."""

    def __init__(self, *sinks: StatsSink | None) -> None:
        self.sinks = tuple(sink for sink in sinks if sink is not None)

    def on_request(self, stats: RequestStats) -> None:
        self._forward("on_request", stats)

    def on_step(self, stats: StepStats) -> None:
        self._forward("on_step", stats)

    def on_scheduler(self, stats: SchedulerStats) -> None:
        self._forward("on_scheduler", stats)

    def on_rejection(self, stats: RejectionStats) -> None:
        self._forward("on_rejection", stats)

    def _forward(self, method: str, stats) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(stats)
            except Exception:  # one broken exporter must not stop generation
                log.exception("stats sink %s failed in %s", type(sink).__name__, method)
