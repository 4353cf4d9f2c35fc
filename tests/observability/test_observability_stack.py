"""The observability stack from one config: one sink feeds metrics, traces and TensorBoard."""

from __future__ import annotations

import glob
import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tokenserve.observability.stack import Observability, ObservabilityConfig
from tokenserve.stats import RequestStats


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_one_sink_feeds_every_backend(tmp_path, restore_root_logger):
    registry = CollectorRegistry()
    spans = InMemorySpanExporter()
    observability = Observability(ObservabilityConfig(tensorboard_logdir=str(tmp_path),
                                                      tensorboard_interval_s=3600),
                                  registry, span_exporter=spans)
    observability.start()
    observability.sink.on_request(RequestStats(
        request_id="r", model="m", version="1", arrival_time=1.0, scheduled_time=1.1,
        first_token_time=1.2, finish_time=1.5, token_times=(1.2, 1.5),
        num_prompt_tokens=3, num_generation_tokens=2))
    observability.close()
    assert registry.get_sample_value("vllm:generation_tokens_total",
                                     {"model_name": "m", "model_version": "1"}) == 2
    assert {span.name for span in spans.get_finished_spans()} == {
        "llm_request", "queue", "prefill", "decode"}
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))


def test_only_metrics_by_default():
    observability = Observability(ObservabilityConfig(), CollectorRegistry())
    assert observability.tracer is None and observability.tensorboard is None
    assert observability.sink.sinks == (observability.metrics,)


@pytest.mark.parametrize("bad", [dict(otlp_traces_endpoint="collector:4318"),
                                 dict(tensorboard_logdir=""), dict(log_format="xml"),
                                 dict(max_model_len=0)])
def test_bad_settings_fail_at_construction(bad):
    with pytest.raises(ValueError):
        ObservabilityConfig(**bad)
