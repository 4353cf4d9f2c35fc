"""Benchmark metrics, defined exactly as `vllm bench serve` defines them.

- TTFT: send to first chunk with choices. ITL: every gap between later chunks, pooled over
  all requests. E2E (e2el): send to last chunk.
- TPOT per request: (e2el - ttft) / (output_tokens - 1), only for requests with more than
  one output token (goodput counts the others' TPOT as 0).
- Output tokens: the server's usage.completion_tokens; else the tokenizer's count of the
  generated text; else 1.
- Throughputs divide by the run's wall time; goodput counts requests within every SLO.
- Percentiles are numpy's linear interpolation; an empty series reports 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenserve.bench.client import RequestResult

DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises:
        ValueError: on an unknown metric, a malformed item or a negative bound.
    """
    slos = {}
    for item in items:
        name, separator, bound = item.partition(":")
        if not separator or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be METRIC:MILLISECONDS with METRIC in "
                             f"{', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(bound)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {bound!r} is not a number") from None
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {item!r} must not be negative")
    return slos


@dataclass(frozen=True)
class LatencySummary:
    """mean, median, std and chosen percentiles of one latency series, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> "LatencySummary":
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000
        return cls(float(np.mean(values)), float(np.median(values)), float(np.std(values)),
                   {p: float(np.percentile(values, p)) for p in percentiles})


@dataclass(frozen=True)
class BenchmarkMetrics:
    """One run's results."""

    duration_s: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    """Requests per second that met every SLO; None when no SLO was given."""
    output_throughput: float
    total_token_throughput: float
    latencies: dict[str, LatencySummary]
    """ttft, tpot, itl, e2el."""
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int] = field(default_factory=list)
    """Per request, 0 for failures (request order)."""


def output_length(output: RequestResult, count_tokens: Callable[[str], int] | None) -> int:
    """The server's count, else the tokenizer's, else 1 (vLLM's fallback order)."""
    if output.output_tokens:
        return output.output_tokens
    if count_tokens is not None:
        return count_tokens(output.generated_text)
    return 1


def calculate_metrics(outputs: Sequence[RequestResult], duration_s: float,
                      count_tokens: Callable[[str], int] | None = None,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      goodput_slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregates per-request outputs into the run's metrics.

    Args:
        outputs: one per request sent.
        duration_s: wall time of the run.
        count_tokens: counts tokens of generated text when the server reports no usage.
        percentiles: which percentiles to report.
        goodput_slos_ms: from `parse_goodput`; goodput is computed only when given.
    """
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = 0
    for output in outputs:
        if not output.success:
            output_lens.append(0)
            continue
        num_output = output_length(output, count_tokens)
        output_lens.append(num_output)
        total_input += output.prompt_len
        tpot = 0.0
        if num_output > 1:
            tpot = (output.latency - output.ttft) / (num_output - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)  # requests with one token count as tpot 0 for goodput
        itls.extend(output.itl)
        ttfts.append(output.ttft)
        e2els.append(output.latency)
    completed = len(ttfts)
    total_output = sum(output_lens)
    goodput = None
    if goodput_slos_ms:
        series = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        bounds = [(series[name], bound / 1000) for name, bound in goodput_slos_ms.items()]
        good = sum(all(values[index] <= bound for values, bound in bounds)
                   for index in range(completed))
        goodput = good / duration_s
    peak_tokens_per_s, peak_concurrency = _peaks([o for o in outputs if o.success])
    return BenchmarkMetrics(
        duration_s=duration_s, completed=completed, failed=len(outputs) - completed,
        total_input=total_input, total_output=total_output,
        request_throughput=completed / duration_s, request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        latencies={name: LatencySummary.of(values, percentiles) for name, values in
                   (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els))},
        max_output_tokens_per_s=peak_tokens_per_s, max_concurrent_requests=peak_concurrency,
        output_lens=output_lens)


def _peaks(outputs: Sequence[RequestResult]) -> tuple[float, int]:
    """(most chunks received in any one-second bucket, most requests in flight at once)."""
    if not outputs:
        return 0.0, 0
    origin = min(output.start_time for output in outputs)
    end = max(output.start_time + output.latency for output in outputs)
    per_second = np.zeros(int(math.ceil(end - origin)) + 1)
    events = []
    for output in outputs:
        token_time = output.start_time + output.ttft
        for gap in [0.0, *output.itl]:
            token_time += gap
            per_second[int(token_time - origin)] += 1
        events += [(output.start_time, 1), (output.start_time + output.latency, -1)]
    in_flight = peak = 0
    for _, change in sorted(events):  # at equal times, a finish (-1) sorts before a start
        in_flight += change
        peak = max(peak, in_flight)
    return float(per_second.max()), peak
