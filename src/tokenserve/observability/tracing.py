"""OpenTelemetry traces: one span tree per finished request, joined to the caller's trace.

A frontend calls `extract_trace_context` on the incoming HTTP headers or gRPC metadata and
puts the result in `RequestStats.trace_context`. When the request finishes, `RequestTracer`
(a StatsSink) emits, from the request's own timestamps:

    llm_request              arrival .. finish   (child of the caller's span, if any)
    ├── queue                arrival .. scheduled
    ├── prefill              scheduled .. first token
    └── decode               first token .. finish

Example:
    >>> provider = make_tracer_provider(TracingConfig(otlp_endpoint="http://otel:4318"))
    >>> tracer = RequestTracer(provider)  # the engine's stats sink (or in a FanOutSink)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenserve.stats import RequestStats, StatsSink

TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TracingConfig:
    """Where traces go. Tracing is off when `otlp_endpoint` is None."""

    otlp_endpoint: str | None = None
    """OTLP/HTTP collector, e.g. http://otel-collector:4318 (/v1/traces is added when the URL
    has no path) or the full traces URL."""
    service_name: str = "tokenserve"
    """`service.name` resource attribute the spans are reported under."""

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None:
            parts = urlsplit(self.otlp_endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError("otlp_endpoint must be an http(s) URL, got "
                                 f"{self.otlp_endpoint!r}")

    @property
    def traces_url(self) -> str | None:
        """The OTLP/HTTP traces URL, with the standard /v1/traces path when none was given."""
        if self.otlp_endpoint is None:
            return None
        if urlsplit(self.otlp_endpoint).path.strip("/"):
            return self.otlp_endpoint
        return self.otlp_endpoint.rstrip("/") + "/v1/traces"


def make_tracer_provider(config: TracingConfig,
                         exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A TracerProvider exporting over OTLP/HTTP in batches, or None when tracing is off.

    Args:
        config: the endpoint and service name.
        exporter: replaces the OTLP exporter (tests pass an in-memory one); with it a
            provider is made even without an endpoint.
    """
    if exporter is None:
        if config.traces_url is None:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.traces_url)
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def extract_trace_context(carrier: Mapping[str, str] | Iterable[tuple[str, str]]
                          ) -> dict[str, str]:
    """The W3C trace headers in HTTP headers or gRPC metadata, keys lower-cased.

    Args:
        carrier: a header mapping (Starlette's Headers, a dict) or gRPC's
            `context.invocation_metadata()` (a sequence of key/value pairs).

    Returns:
        {"traceparent": ..., "tracestate": ...} with only the keys present; store it in
        `RequestStats.trace_context`.
    """
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
    found = {}
    for key, header_value in pairs:
        key = key.lower()
        if key in TRACE_HEADERS:
            found[key] = header_value.decode() if isinstance(header_value, bytes) \
                else str(header_value)
    return found


def inject_trace_context(context=None) -> dict[str, str]:
    """The W3C headers for the current (or given) span context, to hand a trace onward."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer(StatsSink):
    """Turns each RequestStats into a request span with queue, prefill and decode children.

    Args:
        provider: from `make_tracer_provider`; the tracer is taken from it, not from the
            global provider, so several servers in one process don't collide.
    """

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tokenserve")

    def on_request(self, stats: RequestStats) -> None:
        parent = _PROPAGATOR.extract(carrier=dict(stats.trace_context))
        attributes = {
            "gen_ai.request.id": stats.request_id,
            "gen_ai.response.model": stats.model,
            "tokenserve.model_version": stats.version,
            "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.num_generation_tokens,
            "gen_ai.response.finish_reasons": [stats.finish_reason],
            "gen_ai.request.n": stats.n,
            "gen_ai.latency.e2e": stats.finish_time - stats.arrival_time,
            "tokenserve.num_preemptions": stats.num_preemptions,
        }
        if stats.num_nonfinite_logits:
            attributes["tokenserve.num_nonfinite_logits"] = stats.num_nonfinite_logits
        if stats.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = \
                stats.first_token_time - stats.arrival_time
        if stats.scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = stats.scheduled_time - stats.arrival_time
        request_span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                              start_time=_ns(stats.arrival_time),
                                              attributes=attributes)
        if stats.finish_reason == "abort":
            request_span.set_status(trace.Status(trace.StatusCode.ERROR, "aborted"))
        inside = trace.set_span_in_context(request_span)
        for name, start, end in self._phases(stats):
            self.tracer.start_span(name, context=inside, start_time=_ns(start)).end(
                end_time=_ns(end))
        request_span.end(end_time=_ns(stats.finish_time))

    @staticmethod
    def _phases(stats: RequestStats) -> list[tuple[str, float, float]]:
        """(name, start, end) of the phases the request reached."""
        if stats.scheduled_time is None:
            return [("queue", stats.arrival_time, stats.finish_time)]
        phases = [("queue", stats.arrival_time, stats.scheduled_time)]
        if stats.first_token_time is None:
            return phases + [("prefill", stats.scheduled_time, stats.finish_time)]
        return phases + [("prefill", stats.scheduled_time, stats.first_token_time),
                         ("decode", stats.first_token_time, stats.finish_time)]

    def shutdown(self) -> None:
        """Flushes pending spans and stops the exporter."""
        self.provider.shutdown()
