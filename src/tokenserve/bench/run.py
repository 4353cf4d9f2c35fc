"""One benchmark: for each request rate, send the whole dataset and measure it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from tokenserve.bench.client import ClientConfig, RequestResult, StreamingClient
from tokenserve.bench.dataset import BenchRequest
from tokenserve.bench.load import LoadConfig, run_load
from tokenserve.bench.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, calculate_metrics


@dataclass(frozen=True)
class RunResult:
    """One run at one request rate: its settings, metrics and per-request outputs."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    metrics: BenchmarkMetrics
    outputs: list[RequestResult]


@dataclass(frozen=True)
class SweepConfig:
    """The load of a benchmark: one run per request rate, the rest shared."""

    request_rates: tuple[float, ...] = (math.inf,)
    """Several rates make a sweep; each run sends the whole dataset."""
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    """SLOs in milliseconds by metric (ttft, tpot, e2el); empty: no goodput."""
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rates:
            raise ValueError("give at least one request rate")
        for rate in self.request_rates:  # validated here rather than midway through a sweep
            LoadConfig(rate, self.burstiness, self.max_concurrency, self.seed)
        if any(not 0 < p < 100 for p in self.percentiles):
            raise ValueError(f"percentiles must be in (0, 100), got {self.percentiles}")


async def run_sweep(client_config: ClientConfig, requests: Sequence[BenchRequest],
                    sweep: SweepConfig,
                    count_tokens: Callable[[str], int] | None = None) -> list[RunResult]:
    """Runs the dataset once per request rate, in the order given.

    Args:
        client_config: server, model and endpoint.
        requests: the dataset.
        sweep: rates and the shared load settings.
        count_tokens: counts output tokens when the server reports no usage.
    """
    results = []
    async with StreamingClient(client_config, sweep.max_concurrency) as client:
        for rate in sweep.request_rates:
            load = LoadConfig(rate, sweep.burstiness, sweep.max_concurrency, sweep.seed)
            label = "inf" if math.isinf(rate) else f"{rate:g}"
            with tqdm(total=len(requests), desc=f"rate {label} req/s", unit="req",
                      disable=not sweep.show_progress) as progress:
                outputs, duration_s = await run_load(requests, client.send, load,
                                                     on_done=lambda _: progress.update(1))
            metrics = calculate_metrics(outputs, duration_s, count_tokens, sweep.percentiles,
                                        sweep.goodput_slos_ms)
            results.append(RunResult(rate, sweep.burstiness, sweep.max_concurrency, metrics,
                                     outputs))
    return results


async def resolve_model(client_config: ClientConfig) -> str:
    """The configured model, or the first one the server lists."""
    if client_config.model:
        return client_config.model
    async with StreamingClient(client_config) as client:
        return await client.first_model()
