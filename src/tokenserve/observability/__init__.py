"""Observability: Prometheus metrics, OpenTelemetry traces, TensorBoard summaries and profiles,
structured logs. Fed by the stats dataclasses in `tokenserve.stats`; imports neither engine
nor server."""
