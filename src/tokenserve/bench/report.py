"""Benchmark output: a printed table, JSON in `vllm bench serve`'s key names, PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenserve.bench.client import RequestOutput
from tokenserve.bench.metrics import LATENCY_METRICS, BenchmarkMetrics

METRIC_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token",
                 "itl": "Inter-token latency", "e2el": "End-to-end latency"}


@dataclass(frozen=True)
class RunResult:
    """One run at one request rate: its settings, metrics and per-request outputs."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]

    @property
    def rate_label(self) -> str:
        return "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"


def _percentile_key(percentile: float, metric: str) -> str:
    word = str(int(percentile)) if float(percentile).is_integer() else str(percentile)
    return f"p{word}_{metric}_ms"


def run_to_json(run: RunResult) -> dict:
    """The run as vLLM names its result fields (plus per-request e2els and tpots)."""
    metrics = run.metrics
    result = {
        "request_rate": run.rate_label if math.isinf(run.request_rate) else run.request_rate,
        "burstiness": run.burstiness, "max_concurrency": run.max_concurrency,
        "duration": metrics.duration_s, "completed": metrics.completed,
        "failed": metrics.failed, "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for metric in LATENCY_METRICS:
        summary = metrics.latencies[metric]
        result[f"mean_{metric}_ms"] = summary.mean_ms
        result[f"median_{metric}_ms"] = summary.median_ms
        result[f"std_{metric}_ms"] = summary.std_ms
        for percentile, point in summary.percentiles_ms.items():
            result[_percentile_key(percentile, metric)] = point
    outputs = run.outputs
    result.update({
        "input_lens": [output.prompt_len for output in outputs],
        "output_lens": metrics.output_lens,
        "ttfts": [output.ttft for output in outputs],
        "itls": [output.itl for output in outputs],
        "e2els": [output.latency for output in outputs],
        "errors": [output.error for output in outputs],
    })
    return result


def write_json(path: Path, config: dict, runs: Sequence[RunResult]) -> Path:
    """Writes {"config": ..., "runs": [...]} (strict JSON: an infinite rate is "inf")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "runs": [run_to_json(r) for r in runs]},
                               indent=2, allow_nan=False))
    return path


def print_table(runs: Sequence[RunResult], console=None) -> None:
    """One column per request rate, so a sweep (or several servers) reads side by side."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="tokenserve bench", show_lines=False)
    table.add_column("metric")
    for run in runs:
        table.add_column(f"rate {run.rate_label}", justify="right")

    def row(name: str, values: list[str]) -> None:
        table.add_row(name, *values)

    row("successful requests", [str(run.metrics.completed) for run in runs])
    row("failed requests", [str(run.metrics.failed) for run in runs])
    row("duration (s)", [f"{run.metrics.duration_s:.2f}" for run in runs])
    row("input tokens", [str(run.metrics.total_input) for run in runs])
    row("output tokens", [str(run.metrics.total_output) for run in runs])
    row("request throughput (req/s)", [f"{run.metrics.request_throughput:.2f}" for run in runs])
    if any(run.metrics.request_goodput is not None for run in runs):
        row("request goodput (req/s)", [f"{run.metrics.request_goodput or 0:.2f}" for run in runs])
    row("output token throughput (tok/s)",
        [f"{run.metrics.output_throughput:.2f}" for run in runs])
    row("total token throughput (tok/s)",
        [f"{run.metrics.total_token_throughput:.2f}" for run in runs])
    for metric in LATENCY_METRICS:
        row(f"mean {metric.upper()} (ms)",
            [f"{run.metrics.latencies[metric].mean_ms:.2f}" for run in runs])
        for percentile in runs[0].metrics.latencies[metric].percentiles_ms:
            row(f"P{percentile:g} {metric.upper()} (ms)",
                [f"{run.metrics.latencies[metric].percentiles_ms[percentile]:.2f}"
                 for run in runs])
    console.print(table)


def _per_request_series(run: RunResult) -> dict[str, list[float]]:
    """Seconds per metric for the successful requests of a run (ITL pooled)."""
    good = [(output, length) for output, length in zip(run.outputs, run.metrics.output_lens)
            if output.success]
    return {
        "ttft": [output.ttft for output, _ in good],
        "tpot": [(output.latency - output.ttft) / (length - 1) for output, length in good
                 if length > 1],
        "itl": [gap for output, _ in good for gap in output.itl],
        "e2el": [output.latency for output, _ in good],
    }


def plot_latency_cdfs(path: Path, runs: Sequence[RunResult]) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency, one line per request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, metric in zip(axes.flat, LATENCY_METRICS):
        for run in runs:
            values = np.sort(np.asarray(_per_request_series(run)[metric])) * 1000
            if values.size:
                axis.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                          label=f"rate {run.rate_label}")
        axis.set_title(METRIC_TITLES[metric])
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_throughput_vs_rate(path: Path, runs: Sequence[RunResult]) -> Path:
    """Achieved request throughput (and goodput) and output-token throughput against the
    offered request rate, lowest rate first and inf last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(runs, key=lambda run: run.request_rate)
    positions = np.arange(len(ordered))
    labels = [run.rate_label for run in ordered]
    figure, (requests_axis, tokens_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    requests_axis.plot(positions, [run.metrics.request_throughput for run in ordered], "o-",
                       label="requests/s")
    if any(run.metrics.request_goodput is not None for run in ordered):
        requests_axis.plot(positions, [run.metrics.request_goodput or 0 for run in ordered],
                           "s--", label="goodput (requests/s within SLOs)")
    requests_axis.set_title("Request throughput")
    requests_axis.set_ylabel("requests/s")
    tokens_axis.plot(positions, [run.metrics.output_throughput for run in ordered], "^-",
                     color="tab:orange", label="output tokens/s")
    tokens_axis.plot(positions, [run.metrics.total_token_throughput for run in ordered], "v--",
                     color="tab:red", label="prompt + output tokens/s")
    tokens_axis.set_title("Token throughput")
    tokens_axis.set_ylabel("tokens/s")
    for axis in (requests_axis, tokens_axis):
        axis.set_xticks(positions, labels)
        axis.set_xlabel("offered request rate (requests/s)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
