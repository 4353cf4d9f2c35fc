"""Request span trees from RequestStats, and W3C traceparent propagation."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tokenserve.observability.tracing import (RequestTracer, TracingConfig,
                                              extract_trace_context, make_tracer_provider)
from tokenserve.stats import RequestStats

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def finished(trace_context: dict, **overrides) -> RequestStats:
    fields = dict(request_id="cmpl-1", model="m", version="3", arrival_time=1000.0,
                  scheduled_time=1000.25, first_token_time=1001.0, finish_time=1002.5,
                  token_times=(1001.0, 1002.5), num_prompt_tokens=5, num_generation_tokens=2,
                  trace_context=trace_context)
    fields.update(overrides)
    return RequestStats(**fields)


def traced(stats: RequestStats):
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(make_tracer_provider(TracingConfig(), exporter=exporter))
    tracer.on_request(stats)
    tracer.shutdown()
    return {span.name: span for span in exporter.get_finished_spans()}


def test_span_tree_joins_the_callers_trace_with_explicit_timestamps():
    headers = {"Traceparent": TRACEPARENT, "Content-Type": "application/json"}
    spans = traced(finished(extract_trace_context(headers)))
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    request = spans["llm_request"]
    assert request.context.trace_id == int(TRACE_ID, 16)
    assert request.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert request.parent.is_remote
    for name in ("queue", "prefill", "decode"):
        assert spans[name].context.trace_id == int(TRACE_ID, 16)
        assert spans[name].parent.span_id == request.context.span_id
    timeline = [(spans[n].start_time, spans[n].end_time) for n in ("queue", "prefill", "decode")]
    assert timeline == [(1000_000_000_000, 1000_250_000_000), (1000_250_000_000, 1001_000_000_000),
                        (1001_000_000_000, 1002_500_000_000)]
    assert (request.start_time, request.end_time) == (1000_000_000_000, 1002_500_000_000)
    assert request.attributes["gen_ai.usage.completion_tokens"] == 2
    assert request.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(1.0)


def test_grpc_metadata_pairs_and_no_parent():
    metadata = (("user-agent", "grpc-python"), ("traceparent", TRACEPARENT),
                ("tracestate", "vendor=1"))
    assert extract_trace_context(metadata) == {"traceparent": TRACEPARENT,
                                               "tracestate": "vendor=1"}
    spans = traced(finished({}))
    assert spans["llm_request"].parent is None
    assert spans["llm_request"].context.trace_id != int(TRACE_ID, 16)


def test_a_request_with_nonfinite_logits_says_so_on_its_span():
    assert "tokenserve.num_nonfinite_logits" not in traced(finished({}))["llm_request"].attributes
    broken = traced(finished({}, num_nonfinite_logits=2))["llm_request"]
    assert broken.attributes["tokenserve.num_nonfinite_logits"] == 2


def test_request_aborted_in_queue_has_only_a_queue_span():
    spans = traced(finished({"traceparent": TRACEPARENT}, scheduled_time=None,
                            first_token_time=None, token_times=(), finish_reason="abort"))
    assert set(spans) == {"llm_request", "queue"}
    assert spans["queue"].end_time == spans["llm_request"].end_time
    assert not spans["llm_request"].status.is_ok


def test_config_adds_the_standard_traces_path():
    assert TracingConfig("http://otel:4318").traces_url == "http://otel:4318/v1/traces"
    assert TracingConfig("http://otel:4318/custom").traces_url == "http://otel:4318/custom"
    assert make_tracer_provider(TracingConfig()) is None
    with pytest.raises(ValueError):
        TracingConfig("otel:4317")


def test_spans_reach_an_otlp_http_collector():
    """The real OTLP/HTTP exporter, against a collector double that decodes what it receives."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    received = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        config = TracingConfig(f"http://127.0.0.1:{collector.server_port}",
                               service_name="tokenserve-test")
        tracer = RequestTracer(make_tracer_provider(config))
        tracer.on_request(finished({"traceparent": TRACEPARENT}))
        tracer.shutdown()
    finally:
        collector.shutdown()
    (path, export), = received
    assert path == "/v1/traces"
    (resource_spans,) = export.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "tokenserve-test"
    spans = [span for scope in resource_spans.scope_spans for span in scope.spans]
    assert sorted(span.name for span in spans) == ["decode", "llm_request", "prefill", "queue"]
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}
