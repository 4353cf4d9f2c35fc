"""Periodic TensorBoard summaries of serving latency, throughput and batching.

`TensorBoardWriter` is a StatsSink: it buffers what it receives and, every `interval_s`, a
background thread writes one point per series with `tf.summary`:

    scalars     latency/{ttft,itl,e2e}_{p50,p95,p99}_ms,
                throughput/{generation,prompt}_tokens_per_s, throughput/requests_per_s,
                scheduler/{num_running,num_waiting,cache_usage}
    histograms  latency/{ttft,itl,e2e}_ms, scheduler/batch_size

Example:
    >>> writer = TensorBoardWriter(TensorBoardConfig(logdir="/var/log/tokenserve/tb"))
    >>> writer.start()  # then pass it (or a FanOutSink holding it) as the engine's stats
    >>> writer.close()  # at shutdown: writes what is left
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from tokenserve.stats import RequestStats, StatsSink, StepStats

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class TensorBoardConfig:
    """Where and how often to write summaries."""

    logdir: str
    """Directory for the event files (point `tensorboard --logdir` at it)."""
    interval_s: float = 10.0
    """Seconds between two written points."""

    def __post_init__(self) -> None:
        if not self.logdir:
            raise ValueError("logdir must not be empty")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


@dataclass
class WindowSummary:
    """What one interval's stats add up to (plain numbers; no TensorFlow)."""

    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_running: int | None = None
    num_waiting: int | None = None
    cache_usage: float | None = None

    def add_request(self, stats: RequestStats) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        self.e2e_ms.append(1000 * (stats.finish_time - stats.arrival_time))
        if stats.first_token_time is not None:
            self.ttft_ms.append(1000 * (stats.first_token_time - stats.arrival_time))
        times = stats.token_times
        self.itl_ms.extend(1000 * (later - earlier) for earlier, later in zip(times, times[1:]))

    def add_step(self, stats: StepStats) -> None:
        if stats.num_running > 0:
            self.batch_sizes.append(stats.num_running)
        self.num_running = stats.num_running
        self.num_waiting = stats.num_waiting
        self.cache_usage = stats.cache_usage

    def scalars(self, elapsed_s: float) -> dict[str, float]:
        """Tag -> value for this window; percentiles only for series that have samples."""
        values: dict[str, float] = {
            "throughput/requests_per_s": self.num_requests / elapsed_s,
            "throughput/prompt_tokens_per_s": self.num_prompt_tokens / elapsed_s,
            "throughput/generation_tokens_per_s": self.num_generation_tokens / elapsed_s,
        }
        for name, samples in (("ttft", self.ttft_ms), ("itl", self.itl_ms),
                              ("e2e", self.e2e_ms)):
            if samples:
                for percentile, point in zip(PERCENTILES, np.percentile(samples, PERCENTILES)):
                    values[f"latency/{name}_p{percentile}_ms"] = float(point)
        for name in ("num_running", "num_waiting", "cache_usage"):
            if getattr(self, name) is not None:
                values[f"scheduler/{name}"] = float(getattr(self, name))
        return values

    def histograms(self) -> dict[str, list[float]]:
        """Tag -> samples for the non-empty distributions of this window."""
        series = {"latency/ttft_ms": self.ttft_ms, "latency/itl_ms": self.itl_ms,
                  "latency/e2e_ms": self.e2e_ms, "scheduler/batch_size": self.batch_sizes}
        return {tag: samples for tag, samples in series.items() if samples}


def histogram_buckets(samples: list[float], num_buckets: int = 30) -> np.ndarray:
    """TensorBoard's histogram tensor: rows of (left edge, right edge, count), float64 [k, 3]."""
    values = np.asarray(samples, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    if low == high:
        return np.array([[low - 0.5, high + 0.5, float(values.size)]])
    counts, edges = np.histogram(values, bins=num_buckets, range=(low, high))
    return np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)


def _metadata(plugin_name: str):
    """SummaryMetadata naming TensorBoard's scalars or histograms plugin.

    Written with `tf.summary.write` directly: TF 2.21's `tf.summary.scalar` is only a stub
    without the tensorboard package, which the server does not need.
    """
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = plugin_name
    return metadata


class TensorBoardWriter(StatsSink):
    """Buffers stats and writes one summary point per interval from a background thread.

    Args:
        config: logdir and interval.
    """

    def __init__(self, config: TensorBoardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._window = WindowSummary()
        self._window_start = time.monotonic()
        self._step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file_writer = None

    def on_request(self, stats: RequestStats) -> None:
        with self._lock:
            self._window.add_request(stats)

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            self._window.add_step(stats)

    def start(self) -> None:
        """Starts the background writer thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tensorboard-writer",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.write_now()

    def write_now(self) -> dict[str, float]:
        """Writes the current window as one point and starts a new window.

        Returns:
            The scalars written.
        """
        import tensorflow as tf

        with self._lock:
            window, self._window = self._window, WindowSummary()
            now = time.monotonic()
            elapsed_s, self._window_start = max(now - self._window_start, 1e-9), now
            step, self._step = self._step, self._step + 1
        if self._file_writer is None:
            self._file_writer = tf.summary.create_file_writer(self.config.logdir)
        scalars = window.scalars(elapsed_s)
        with self._file_writer.as_default(step=step):
            for tag, point in scalars.items():
                tf.summary.write(tag, tf.constant(point, tf.float32), metadata=_metadata("scalars"))
            for tag, samples in window.histograms().items():
                tf.summary.write(tag, tf.constant(histogram_buckets(samples), tf.float64),
                                 metadata=_metadata("histograms"))
        self._file_writer.flush()
        return scalars

    def close(self) -> None:
        """Stops the thread, writes the last partial window, and closes the event file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.write_now()
        self._file_writer.close()
