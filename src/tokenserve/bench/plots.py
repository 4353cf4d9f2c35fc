"""PNG plots of benchmark run records (see report.py): latency CDFs and throughput against
the offered request rate, one line per run or per label."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokenserve.bench.metrics import LATENCY_METRICS
from tokenserve.bench.report import column_titles, rate_label

METRIC_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token",
                 "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def per_request_seconds(run: dict) -> dict[str, list[float]]:
    """Seconds per metric over a run record's successful requests (ITL gaps pooled; TPOT
    only for requests with more than one output token)."""
    good = [index for index, error in enumerate(run["errors"]) if not error]
    ttfts, e2els, lengths = run["ttfts"], run["e2els"], run["output_lens"]
    return {
        "ttft": [ttfts[i] for i in good],
        "tpot": [(e2els[i] - ttfts[i]) / (lengths[i] - 1) for i in good if lengths[i] > 1],
        "itl": [gap for i in good for gap in run["itls"][i]],
        "e2el": [e2els[i] for i in good],
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
    return path


def plot_latency_cdfs(path: Path, runs: Sequence[dict]) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency, one line per run."""
    plt = _pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    titles = column_titles(runs)
    for axis, metric in zip(axes.flat, LATENCY_METRICS):
        for run, title in zip(runs, titles):
            values = np.sort(np.asarray(per_request_seconds(run)[metric])) * 1000
            if values.size:
                axis.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                          label=title)
        axis.set_title(METRIC_TITLES[metric])
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of gaps" if metric == "itl" else "fraction of requests")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    return _save(figure, path)


def _rate_key(rate) -> float:
    return math.inf if rate_label(rate) == "inf" else float(rate)


def plot_throughput_vs_rate(path: Path, runs: Sequence[dict]) -> Path:
    """Achieved request throughput (and goodput) and token throughput against the offered
    request rate (ascending, inf last), one line per label."""
    plt = _pyplot()
    rates = sorted({rate_label(run["request_rate"]) for run in runs}, key=_rate_key)
    position = {rate: index for index, rate in enumerate(rates)}
    labels = list(dict.fromkeys(run.get("label", "") for run in runs))
    figure, (requests_axis, tokens_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, label in enumerate(labels):
        color = f"C{index}"  # one colour per server/configuration
        mine = sorted((run for run in runs if run.get("label", "") == label),
                      key=lambda run: _rate_key(run["request_rate"]))
        xs = [position[rate_label(run["request_rate"])] for run in mine]
        prefix = f"{label}: " if len(labels) > 1 else ""
        requests_axis.plot(xs, [run["request_throughput"] for run in mine], "o-", color=color,
                           label=f"{prefix}requests/s")
        if any(run.get("request_goodput") is not None for run in mine):
            requests_axis.plot(xs, [run.get("request_goodput") or 0 for run in mine], "s--",
                               color=color, label=f"{prefix}goodput (within SLOs)")
        tokens_axis.plot(xs, [run["output_throughput"] for run in mine], "^-", color=color,
                         label=f"{prefix}output tokens/s")
        tokens_axis.plot(xs, [run["total_token_throughput"] for run in mine], "v--",
                         color=color, label=f"{prefix}prompt + output tokens/s")
    requests_axis.set_title("Request throughput")
    requests_axis.set_ylabel("requests/s")
    tokens_axis.set_title("Token throughput")
    tokens_axis.set_ylabel("tokens/s")
    for axis in (requests_axis, tokens_axis):
        axis.set_xticks(range(len(rates)), rates)
        axis.set_xlabel("offered request rate (requests/s)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="best")
    return _save(figure, path)
