"""A mixture of experts' routing as a Prometheus histogram: tokens per expert per step.

`tokenserve:moe_expert_tokens` has one series set per (model, version, layer): each step
observes, for every expert of the layer, the rows routed to it that step (zeros included),
so an even router piles its observations into one bucket and an imbalanced one spreads
them from the zero bucket (idle experts) to the top ones (hot experts). Experts are not a
label (128 experts x 48 layers would be 6,144 series a version); the layer is, bounded by the
model's depth. Bucketed with NumPy at each step and exposed at scrape time, since observing
every expert one by one costs a Python call each.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tokenserve.stats import StepStats

NAME = "tokenserve:moe_expert_tokens"
DOC = ("Rows routed to each expert of a mixture-of-experts layer per engine step "
       "(one observation per expert per step).")
BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExpertLoadCollector:
    """Accumulates StepStats.expert_tokens per (model, version); a prometheus_client
    collector (register it on the registry)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (model, version) -> (bucket counts [layers, buckets + 1], sums [layers])
        self.series: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self.edges = np.asarray(BUCKETS, np.int64)

    def observe(self, stats: StepStats) -> None:
        if not stats.expert_tokens:
            return
        tokens = np.asarray(stats.expert_tokens, np.int64)               # [layers, experts]
        slots = np.searchsorted(self.edges, tokens, side="left")        # bucket le >= value
        layers = tokens.shape[0]
        with self.lock:
            key = (stats.model, stats.version)
            if key not in self.series or self.series[key][0].shape[0] != layers:
                self.series[key] = (np.zeros([layers, len(BUCKETS) + 1], np.int64),
                                    np.zeros([layers], np.int64))
            counts, sums = self.series[key]
            # a dense layer among MoE ones routes nothing (its row is all zeros): no
            # observations, so it shows no idle experts; a MoE layer routes every row
            routed = np.repeat(tokens.any(axis=1), tokens.shape[1])
            np.add.at(counts, (np.repeat(np.arange(layers), tokens.shape[1])[routed],
                               slots.ravel()[routed]), 1)
            sums += tokens.sum(axis=1)

    def collect(self):
        family = HistogramMetricFamily(NAME, DOC, labels=("model_name", "model_version",
                                                          "layer"))
        with self.lock:
            snapshot = [(key, counts.copy(), sums.copy())
                        for key, (counts, sums) in self.series.items()]
        for (model, version), counts, sums in snapshot:
            cumulative = np.cumsum(counts, axis=1)
            for layer in np.flatnonzero(cumulative[:, -1]):  # layers that routed rows
                buckets = [(floatToGoString(edge), int(cumulative[layer, i]))
                           for i, edge in enumerate(BUCKETS)]
                buckets.append(("+Inf", int(cumulative[layer, -1])))
                family.add_metric([model, version, str(layer)], buckets, int(sums[layer]))
        yield family
