"""FanOutSink forwards to every backend and survives a broken one."""

from __future__ import annotations

from tokenserve.observability.sinks import FanOutSink
from tokenserve.stats import RejectionStats, StatsSink


class Recorder(StatsSink):
    def __init__(self):
        self.rejections = []

    def on_rejection(self, stats):
        self.rejections.append(stats.reason)


class Broken(StatsSink):
    def on_rejection(self, stats):
        raise RuntimeError("exporter down")


def test_every_sink_gets_every_stat_even_after_a_failure(caplog):
    first, last = Recorder(), Recorder()
    sink = FanOutSink(first, None, Broken(), last)
    sink.on_rejection(RejectionStats(model="m", version="1", reason="queue_full"))
    assert first.rejections == last.rejections == ["queue_full"]
    assert "Broken failed in on_rejection" in caplog.text
