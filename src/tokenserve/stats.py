"""Stats the engine, the servers and the lifecycle emit as plain data. Observability
(Prometheus, OpenTelemetry, TensorBoard) consumes these and imports none of them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class VersionState(enum.IntEnum):
    """Lifecycle of one model version; names and values are TF Serving's
    `ModelVersionStatus.State` (get_model_status.proto). The lifecycle sets it, GetModelStatus
    reports it, and the metrics label `tokenserve:model_version_state` with its name."""

    START = 10
    LOADING = 20
    AVAILABLE = 30
    UNLOADING = 40
    END = 50


@dataclass(frozen=True)
class RequestStats:
    """One finished request, with wall-clock times from `time.time()` in seconds."""

    request_id: str
    model: str
    version: str
    arrival_time: float
    scheduled_time: float | None
    """When it was first given cache space (end of queueing); None if it never was."""
    first_token_time: float | None
    finish_time: float
    token_times: tuple[float, ...] = ()
    """Time each generated token (of the first sequence) was emitted; gives ITL."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefill_time_s: float = 0.0
    """Time spent in engine steps while this request's prompt was being computed."""
    decode_time_s: float = 0.0
    finish_reason: str = "stop"
    """stop, length or abort."""
    n: int = 1
    num_preemptions: int = 0
    num_nonfinite_logits: int = 0
    """Tokens chosen from logits that held a NaN or +inf (StepStats has the same count)."""
    trace_context: dict = field(default_factory=dict)
    """W3C trace headers (traceparent, tracestate) the request arrived with, if any."""


@dataclass(frozen=True)
class StepStats:
    """One engine step."""

    model: str
    version: str
    time: float
    duration_s: float
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    """Tokens computed this step (decode tokens plus prefill chunk tokens)."""
    num_prefill_tokens: int
    num_decode_tokens: int
    cache_usage: float
    """Fraction of KV-cache blocks (or LSTM state slots) in use, 0..1."""
    num_preemptions: int = 0
    """Sequences preempted (by recompute) during this step's scheduling."""
    num_draft_tokens: int = 0
    """Drafted tokens this step checked (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Of those, the ones the model agreed with (kept in the output)."""
    num_nonfinite_logits: int = 0
    """Tokens chosen this step from logits that held a NaN or +inf: a broken model (its
    weights, or an input it overflows on). Sampling stays defined for them (a NaN is never
    drawn, +inf tokens share the mass), but the text is not what a working model says."""
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    """A mixture of experts' load: rows routed to each expert of each layer this step,
    [layer][expert] (a row counts once for each expert it chose); empty without experts."""


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues after they changed outside a step: a request aborted (its
    client left, or its deadline passed) frees its place and its cache at once, and when it
    was the last one no step follows to report that. Gauges of running and waiting requests
    and of cache usage take these values, as they take a step's."""

    model: str
    version: str
    time: float
    num_running: int
    num_waiting: int
    cache_usage: float


@dataclass(frozen=True)
class RejectionStats:
    """A request refused before it reached the engine queue."""

    model: str
    version: str
    reason: str
    """queue_full, invalid, too_long, unauthenticated, timeout ..."""


class StatsSink:
    """Receives stats; observability backends subclass it. The default drops everything."""

    def on_request(self, stats: RequestStats) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_scheduler(self, stats: SchedulerStats) -> None:
        pass

    def on_rejection(self, stats: RejectionStats) -> None:
        pass
