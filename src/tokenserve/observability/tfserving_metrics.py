"""TF Serving's metric names, on the registry `tokenserve serve` creates.

Names and labels are TF Serving's, so existing dashboards and alerts keep working:
`:tensorflow:serving:request_count{model_name,status}`,
`:tensorflow:serving:request_latency{model_name,API,entrypoint}` (microseconds),
`:tensorflow:serving:runtime_latency{model_name,API,runtime}`,
`:tensorflow:cc:saved_model:load_attempt_count{model_path,status}`,
`:tensorflow:cc:saved_model:load_latency{model_path}` (microseconds, cumulative) and
`:tensorflow:serving:model_warmup_latency{model_path,status}` (microseconds).

Why counters are emitted as `untyped`: prometheus_client appends `_total` to every counter
sample, but TF Serving exports `:tensorflow:serving:request_count` with no suffix, and that
sample name is what PromQL queries and dashboards match. A counter family named without
`_total` would still print `# TYPE ..._total counter` over samples of another name, which
Prometheus reads as untyped anyway. So these families are collected by hand as `untyped`
with TF Serving's exact sample names; rate()/increase() work on them as before. Histograms
keep prometheus_client's `_bucket/_sum/_count`, which is also what TF Serving prints.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric

# TF Serving's request latency buckets: exponential from 10 us by a factor of 1.8.
LATENCY_BUCKETS_US = tuple(10 * 1.8 ** i for i in range(33))


class _UntypedCounters:
    """Monotonic counters exposed under exact names (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._families: dict[str, tuple[str, tuple[str, ...], dict]] = {}

    def family(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self._families[name] = (documentation, labels, defaultdict(float))

    def inc(self, name: str, amount: float, **labels: str) -> None:
        _, names, values = self._families[name]
        with self._lock:
            values[tuple(labels[n] for n in names)] += amount

    def collect(self):
        with self._lock:
            snapshot = {name: (doc, names, dict(values))
                        for name, (doc, names, values) in self._families.items()}
        for name, (doc, names, values) in snapshot.items():
            metric = Metric(name, doc, "unknown")
            for key, value in sorted(values.items()):
                metric.add_sample(name, dict(zip(names, key)), value)
            yield metric


class TFServingMetrics:
    """Records requests, loads and warmups under TF Serving's metric names.

    Args:
        registry: the server's CollectorRegistry (shared with the LLM metrics).
    """

    REQUEST_COUNT = ":tensorflow:serving:request_count"
    LOAD_ATTEMPTS = ":tensorflow:cc:saved_model:load_attempt_count"
    LOAD_LATENCY = ":tensorflow:cc:saved_model:load_latency"

    def __init__(self, registry: CollectorRegistry):
        self._model_names: Callable[[], Iterable[str]] | None = None
        self._counters = _UntypedCounters()
        self._counters.family(self.REQUEST_COUNT, "The total number of requests.",
                              ("model_name", "status"))
        self._counters.family(self.LOAD_ATTEMPTS, "The number of times a SavedModel was "
                              "successfully loaded.", ("model_path", "status"))
        self._counters.family(self.LOAD_LATENCY, "Latency in microseconds for SavedModels "
                              "that were successfully loaded.", ("model_path",))
        registry.register(self._counters)
        self._request_latency = Histogram(
            ":tensorflow:serving:request_latency",
            "Distribution of wall time (in microseconds) for Tensorflow Serving request.",
            ("model_name", "API", "entrypoint"), buckets=LATENCY_BUCKETS_US, registry=registry)
        self._runtime_latency = Histogram(
            ":tensorflow:serving:runtime_latency",
            "Distribution of wall time (in microseconds) for Tensorflow runtime.",
            ("model_name", "API", "runtime"), buckets=LATENCY_BUCKETS_US, registry=registry)
        self._warmup_latency = Histogram(
            ":tensorflow:serving:model_warmup_latency",
            "Distribution of wall time (in microseconds) for warming up the model.",
            ("model_path", "status"), buckets=LATENCY_BUCKETS_US, registry=registry)

    UNKNOWN_MODEL = "(unknown)"

    def label_models(self, model_names: Callable[[], Iterable[str]]) -> None:
        """Labels requests with `model_name` only when it is one of `model_names()` (the
        configured models) and counts the rest under UNKNOWN_MODEL: a name comes from the
        request (URL path or ModelSpec), and labelling every made-up one would let clients
        grow /metrics without bound."""
        self._model_names = model_names

    def request(self, model_name: str, api: str, entrypoint: str, status: str,
                seconds: float) -> None:
        """One finished request; `status` is "OK" or a status code name. Latency is recorded
        for successful requests only, as TF Serving does."""
        if self._model_names is not None and model_name not in set(self._model_names()):
            model_name = self.UNKNOWN_MODEL
        self._counters.inc(self.REQUEST_COUNT, 1, model_name=model_name, status=status)
        if status == "OK":
            self._request_latency.labels(model_name, api, entrypoint).observe(seconds * 1e6)

    def runtime(self, model_name: str, api: str, seconds: float) -> None:
        self._runtime_latency.labels(model_name, api, "TF1").observe(seconds * 1e6)

    def load(self, model_path: str, seconds: float, ok: bool) -> None:
        self._counters.inc(self.LOAD_ATTEMPTS, 1, model_path=model_path,
                           status="success" if ok else "fail")
        if ok:
            self._counters.inc(self.LOAD_LATENCY, seconds * 1e6, model_path=model_path)

    def warmup(self, model_path: str, seconds: float, status: str = "OK") -> None:
        self._warmup_latency.labels(model_path, status).observe(seconds * 1e6)
