"""Benchmark results as JSON in `vllm bench serve`'s key names, and the printed table.

The JSON run record is the one format everything downstream reads: the table and the plots
(`plots.py`) take run records, whether fresh or loaded from earlier results files, so runs
of different servers or configurations compare side by side (`--compare`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from tokenserve.bench.metrics import LATENCY_METRICS
from tokenserve.bench.run import RunResult


def rate_label(rate: float | str) -> str:
    """'inf' or the rate without trailing zeros."""
    if isinstance(rate, str) or math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def _percentile_key(percentile: float, metric: str) -> str:
    word = str(int(percentile)) if float(percentile).is_integer() else str(percentile)
    return f"p{word}_{metric}_ms"


def run_to_json(run: RunResult, label: str) -> dict:
    """One run as vLLM names its result fields, plus `label`, per-request `e2els` and
    `errors` ("" for a success)."""
    metrics = run.metrics
    result = {
        "label": label,
        "request_rate": "inf" if math.isinf(run.request_rate) else run.request_rate,
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
        "errors": [output.error if not output.success else "" for output in outputs],
    })
    return result


def write_json(path: Path, config: dict, runs: Sequence[dict]) -> Path:
    """Writes {"config": ..., "runs": [...]} (strict JSON: an infinite rate is "inf")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "runs": list(runs)}, indent=2,
                               allow_nan=False))
    return path


def load_runs(paths: Sequence[str | Path]) -> list[dict]:
    """The run records of earlier results files, in file order.

    A record without a label gets its file's config model (or the file name).
    """
    runs = []
    for path in paths:
        results = json.loads(Path(path).read_text())
        fallback = results.get("config", {}).get("label") or \
            results.get("config", {}).get("model") or Path(path).stem
        for run in results["runs"]:
            runs.append({"label": fallback, **run} if not run.get("label") else run)
    return runs


def reported_percentiles(run: dict, metric: str = "ttft") -> list[float]:
    """The percentiles a run record holds for `metric`, ascending."""
    pattern = re.compile(rf"^p(\d+(?:\.\d+)?)_{metric}_ms$")
    return sorted(float(match.group(1)) for key in run if (match := pattern.match(key)))


def column_titles(runs: Sequence[dict]) -> list[str]:
    """'rate R', prefixed with the label when the runs carry more than one label."""
    several = len({run.get("label") for run in runs}) > 1
    return [(f"{run['label']} " if several else "") + f"rate {rate_label(run['request_rate'])}"
            for run in runs]


def print_table(runs: Sequence[dict], console=None) -> None:
    """One column per run, so a sweep (or several servers) reads side by side."""
    from rich.console import Console
    from rich.table import Table

    titles = column_titles(runs)
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: don't wrap at 80 columns
            console = Console(width=max(80, 36 + sum(max(len(t), 9) + 3 for t in titles)))
    table = Table(title="tokenserve bench")
    table.add_column("metric")
    for title in titles:
        table.add_column(title, justify="right")

    def row(name: str, key: str, digits: int = 2) -> None:
        cells = []
        for run in runs:
            cell = run.get(key)
            cells.append("-" if cell is None else f"{cell:.{digits}f}")
        table.add_row(name, *cells)

    row("successful requests", "completed", 0)
    row("failed requests", "failed", 0)
    row("duration (s)", "duration")
    row("input tokens", "total_input_tokens", 0)
    row("output tokens", "total_output_tokens", 0)
    row("request throughput (req/s)", "request_throughput")
    if any(run.get("request_goodput") is not None for run in runs):
        row("request goodput (req/s)", "request_goodput")
    row("output token throughput (tok/s)", "output_throughput")
    row("total token throughput (tok/s)", "total_token_throughput")
    for metric in LATENCY_METRICS:
        row(f"mean {metric.upper()} (ms)", f"mean_{metric}_ms")
        for percentile in reported_percentiles(runs[0], metric):
            row(f"P{percentile:g} {metric.upper()} (ms)", _percentile_key(percentile, metric))
    console.print(table)
