"""The whole observability stack from one config: what `tokenserve serve` wires in.

Example:
    >>> registry = CollectorRegistry()     # also given to TFServingMetrics and the /metrics routes
    >>> observability = Observability(ObservabilityConfig(
    ...     otlp_traces_endpoint=args.otlp_traces_endpoint,
    ...     tensorboard_logdir=args.tensorboard_logdir, log_format=args.log_format), registry)
    >>> observability.start()
    >>> engine = AsyncEngine.from_model_dir(path, stats=observability.sink)   # doctest: +SKIP
    >>> app = build_openai_app(models, config, stats=observability.sink)      # doctest: +SKIP
    >>> add_profiler_service(grpc_server)
    >>> ...
    >>> observability.close()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry

from tokenserve.observability.llm_metrics import LLMMetrics, LLMMetricsConfig
from tokenserve.observability.logging import LoggingConfig, configure_logging
from tokenserve.observability.sinks import FanOutSink
from tokenserve.observability.tensorboard import TensorBoardConfig, TensorBoardWriter
from tokenserve.observability.tracing import (RequestTracer, TracingConfig,
                                              make_tracer_provider)


@dataclass(frozen=True)
class ObservabilityConfig:
    """Which backends run. Prometheus metrics always do; the rest are off unless set."""

    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP collector URL (`--otlp_traces_endpoint`); None: no tracing."""
    service_name: str = "tokenserve"
    tensorboard_logdir: str | None = None
    """Where periodic tf.summary points go (`--tensorboard_logdir`); None: none."""
    tensorboard_interval_s: float = 10.0
    max_model_len: int = 4096
    """Top of the token-count histogram buckets (the served model's context length)."""
    log_format: Literal["plain", "json"] = "plain"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        # Build each backend's config once here, so a bad value fails at start-up.
        TracingConfig(self.otlp_traces_endpoint, self.service_name)
        if self.tensorboard_logdir is not None:
            TensorBoardConfig(self.tensorboard_logdir, self.tensorboard_interval_s)
        LLMMetricsConfig(self.max_model_len)
        LoggingConfig(self.log_format, self.log_level)


class Observability:
    """Prometheus metrics, traces and TensorBoard summaries behind one StatsSink (`sink`).

    Args:
        config: which backends run.
        registry: the server's Prometheus registry.
        span_exporter: replaces the OTLP exporter (tests); traces are on when it is given.
    """

    def __init__(self, config: ObservabilityConfig, registry: CollectorRegistry,
                 span_exporter=None) -> None:
        self.config = config
        self.metrics = LLMMetrics(registry, LLMMetricsConfig(config.max_model_len))
        provider = make_tracer_provider(
            TracingConfig(config.otlp_traces_endpoint, config.service_name), span_exporter)
        self.tracer = RequestTracer(provider) if provider is not None else None
        self.tensorboard = None
        if config.tensorboard_logdir is not None:
            self.tensorboard = TensorBoardWriter(
                TensorBoardConfig(config.tensorboard_logdir, config.tensorboard_interval_s))
        self.sink = FanOutSink(self.metrics, self.tracer, self.tensorboard)

    def start(self) -> None:
        """Installs the log format and starts the TensorBoard writer thread."""
        configure_logging(LoggingConfig(self.config.log_format, self.config.log_level))
        if self.tensorboard is not None:
            self.tensorboard.start()

    def close(self) -> None:
        """Writes the last TensorBoard window and flushes pending spans."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.tracer is not None:
            self.tracer.shutdown()
