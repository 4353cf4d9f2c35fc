"""Prometheus LLM metrics under vLLM's names, so vLLM dashboards and autoscalers work unchanged.

Every series carries `model_name` (vLLM's label) and `model_version`. Where vLLM has no metric
the name is `tokenserve:`-prefixed. TF Serving's own names are registered elsewhere
(`tfserving_metrics.py`) on the same registry. The full list is in docs/metrics.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from tokenserve.observability.expert_metrics import ExpertLoadCollector
from tokenserve.stats import (RejectionStats, RequestStats, SchedulerStats, StatsSink, StepStats,
                              VersionState)

LABELS = ("model_name", "model_version")

PREFIX_CACHE_COUNTERS = (
    # (metric, field of the engine's PrefixCacheStats, help)
    ("vllm:prefix_cache_queries", "num_query_tokens",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "num_hit_tokens",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("tokenserve:kv_store_queries", "num_remote_query_tokens",
     "Tokens looked up in the shared KV store after a local prefix-cache miss."),
    ("tokenserve:kv_store_hits", "num_remote_hit_tokens",
     "Tokens loaded from the shared KV store instead of computed."),
    ("tokenserve:kv_store_saved_blocks", "num_remote_saved_blocks",
     "KV blocks written to the shared KV store."),
    ("tokenserve:kv_store_errors", "num_remote_errors",
     "Failed KV-store calls (each served by recomputing)."),
)


class _PrefixCacheCollector:
    """Reads each engine's cumulative prefix-cache counters at scrape time."""

    def __init__(self) -> None:
        self.sources: dict[tuple[str, str], object] = {}  # labels -> () -> PrefixCacheStats
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snapshots = [(labels, read()) for labels, read in self.sources.items()]
        for name, field, doc in PREFIX_CACHE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for labels, stats in snapshots:
                family.add_metric(labels, getattr(stats, field))
            yield family

# Bucket edges are vLLM's own (vllm/v1/metrics/loggers.py), so histogram_quantile over a
# mixed fleet of vLLM and tokenserve replicas aggregates like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_DURATION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
LOAD_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class LLMMetricsConfig:
    """Shape of the histograms that depend on the deployment."""

    max_model_len: int = 4096
    """Upper edge of the prompt/generation token-count buckets (1-2-5 series up to it)."""

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's token-count buckets).

    Example:
        >>> one_two_five_buckets(100)
        (1, 2, 5, 10, 20, 50, 100)
    """
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


class LLMMetrics(StatsSink):
    """Records RequestStats, StepStats and RejectionStats into a Prometheus registry.

    Args:
        registry: where the metrics are registered; serve it with
            `prometheus_client.generate_latest(registry)` at `/metrics`.
        config: bucket shapes.

    Example:
        >>> registry = CollectorRegistry()
        >>> metrics = LLMMetrics(registry)
        >>> engine = AsyncEngine.from_model_dir(path, stats=metrics)  # doctest: +SKIP
    """

    def __init__(self, registry: CollectorRegistry,
                 config: LLMMetricsConfig | None = None) -> None:
        self.config = config or LLMMetricsConfig()
        token_buckets = one_two_five_buckets(self.config.max_model_len)
        self._version_lock = threading.Lock()

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, LABELS + extra, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, LABELS + extra, registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry)

        # Scheduler state, from each engine step.
        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.spec_decode_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens checked.")
        self.spec_decode_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted draft tokens.")
        self.nonfinite_logits = counter(
            "tokenserve:nonfinite_logits",
            "Tokens chosen from logits that held a NaN or +inf: the model is broken.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.batch_size = histogram("tokenserve:batch_size",
                                    "Sequences in the batch of each engine step.",
                                    BATCH_SIZE_BUCKETS)
        self.step_duration = histogram("tokenserve:step_duration_seconds",
                                       "Wall time of each engine step in seconds.",
                                       STEP_DURATION_BUCKETS)

        # Per finished request.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.request_params_n = histogram("vllm:request_params_n",
                                          "Histogram of the n request parameter.", N_BUCKETS)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.",
                                             ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

        # Refusals, and the model lifecycle.
        self.rejected_requests = counter("tokenserve:rejected_requests",
                                         "Requests refused before reaching the engine queue.",
                                         ("reason",))
        self.version_state = gauge("tokenserve:model_version_state",
                                   "1 for the state a model version is in, 0 for the others.",
                                   ("state",))
        self.model_load_latency = histogram("tokenserve:model_load_latency_seconds",
                                            "Time to load a model version in seconds.",
                                            LOAD_LATENCY_BUCKETS)
        self.model_warmup_latency = histogram("tokenserve:model_warmup_latency_seconds",
                                              "Time to warm up a model version in seconds.",
                                              LOAD_LATENCY_BUCKETS)
        self._prefix_cache = _PrefixCacheCollector()
        registry.register(self._prefix_cache)
        self.expert_load = ExpertLoadCollector()  # tokenserve:moe_expert_tokens
        registry.register(self.expert_load)

    def watch_prefix_cache(self, model: str, version: str, read) -> None:
        """Exports an engine's prefix-cache counters; `read()` returns its PrefixCacheStats
        (LLMEngine.prefix_cache_stats), called at every scrape."""
        with self._prefix_cache.lock:
            self._prefix_cache.sources[(model, version)] = read

    def on_step(self, stats: StepStats) -> None:
        labels = (stats.model, stats.version)
        self._set_scheduler_gauges(stats)
        self.num_preemptions.labels(*labels).inc(stats.num_preemptions)
        if stats.num_nonfinite_logits:
            self.nonfinite_logits.labels(*labels).inc(stats.num_nonfinite_logits)
        if stats.num_draft_tokens:
            self.spec_decode_draft_tokens.labels(*labels).inc(stats.num_draft_tokens)
            self.spec_decode_accepted_tokens.labels(*labels).inc(stats.num_accepted_tokens)
        self.step_duration.labels(*labels).observe(stats.duration_s)
        if stats.num_batched_tokens > 0:
            self.iteration_tokens.labels(*labels).observe(stats.num_batched_tokens)
        if stats.num_running > 0:
            self.batch_size.labels(*labels).observe(stats.num_running)
        self.expert_load.observe(stats)

    def on_scheduler(self, stats: SchedulerStats) -> None:
        self._set_scheduler_gauges(stats)

    def _set_scheduler_gauges(self, stats: StepStats | SchedulerStats) -> None:
        labels = (stats.model, stats.version)
        self.num_requests_running.labels(*labels).set(stats.num_running)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage.labels(*labels).set(stats.cache_usage)

    def on_request(self, stats: RequestStats) -> None:
        """Counts tokens from the finished request, so counters equal the usage reported."""
        labels = (stats.model, stats.version)
        self.prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(stats.num_generation_tokens)
        self.request_success.labels(*labels, stats.finish_reason).inc()
        self.request_prompt_tokens.labels(*labels).observe(stats.num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(stats.num_generation_tokens)
        self.request_params_n.labels(*labels).observe(stats.n)
        self.e2e_request_latency.labels(*labels).observe(stats.finish_time - stats.arrival_time)
        for gap in inter_token_latencies(stats):
            self.inter_token_latency.labels(*labels).observe(gap)
            self.time_per_output_token.labels(*labels).observe(gap)
        if stats.scheduled_time is not None:
            self.request_queue_time.labels(*labels).observe(
                stats.scheduled_time - stats.arrival_time)
            self.request_inference_time.labels(*labels).observe(
                stats.finish_time - stats.scheduled_time)
        if stats.first_token_time is None:
            return
        self.time_to_first_token.labels(*labels).observe(
            stats.first_token_time - stats.arrival_time)
        if stats.scheduled_time is not None:
            self.request_prefill_time.labels(*labels).observe(
                stats.first_token_time - stats.scheduled_time)
        last_token_time = stats.token_times[-1] if stats.token_times else stats.finish_time
        decode_time = max(last_token_time - stats.first_token_time, 0.0)
        self.request_decode_time.labels(*labels).observe(decode_time)
        if stats.num_generation_tokens > 1:
            self.request_time_per_output_token.labels(*labels).observe(
                decode_time / (stats.num_generation_tokens - 1))

    def on_rejection(self, stats: RejectionStats) -> None:
        self.rejected_requests.labels(stats.model, stats.version, stats.reason).inc()

    def record_version_state(self, model: str, version: str, state: VersionState | str) -> None:
        """Marks `state` (a VersionState or its name) as the version's current state (1) and
        every other state 0.

        Raises:
            ValueError: `state` names no VersionState.
        """
        if isinstance(state, str):
            if state not in VersionState.__members__:
                raise ValueError(f"{state!r} is not a version state")
            state = VersionState[state]
        current = VersionState(state)
        with self._version_lock:
            for candidate in VersionState:
                self.version_state.labels(model, version, candidate.name).set(
                    1 if candidate is current else 0)

    def forget_version(self, model: str, version: str) -> None:
        """Drops an unloaded version's scheduler gauges, so dashboards stop showing its last
        running/waiting/cache values. Counters and histograms stay (Prometheus rates need
        them to stay monotonic); its version state keeps reading END if recorded."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage):
            try:
                gauge.remove(model, version)
            except KeyError:  # that version never ran a step
                pass
        with self._prefix_cache.lock:  # its counters stay, frozen at their last values
            read = self._prefix_cache.sources.get((model, version))
            if read is not None:
                last = read()
                self._prefix_cache.sources[(model, version)] = lambda: last

    # -- the lifecycle's observer interface (ModelManager.add_observer) --------------------
    def on_version_state(self, model: str, version: int, state) -> None:
        """A version changed state (a VersionState or its name). At END its scheduler
        gauges go: its engine has stopped, and a dashboard should not keep showing its last
        running and waiting counts."""
        self.record_version_state(model, str(version), state)
        if getattr(state, "name", state) == VersionState.END.name:
            self.forget_version(model, str(version))

    def on_load(self, model: str, version: int, seconds: float, ok: bool) -> None:
        if ok:
            self.record_model_load(model, str(version), seconds)

    def on_warmup(self, model: str, version: int, seconds: float) -> None:
        self.record_warmup(model, str(version), seconds)

    def record_model_load(self, model: str, version: str, seconds: float) -> None:
        """Observes how long loading one model version took."""
        self.model_load_latency.labels(model, version).observe(seconds)

    def record_warmup(self, model: str, version: str, seconds: float) -> None:
        """Observes how long warming up one model version took."""
        self.model_warmup_latency.labels(model, version).observe(seconds)


def inter_token_latencies(stats: RequestStats) -> list[float]:
    """Gaps between consecutive emitted tokens of the first sequence, in seconds."""
    times = stats.token_times
    return [later - earlier for earlier, later in zip(times, times[1:])]
