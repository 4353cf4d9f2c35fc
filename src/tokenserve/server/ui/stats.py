"""GET /ui/api/stats: one JSON snapshot of what the dashboard draws.

Counters and histogram buckets are cumulative, as in /metrics, summed over every model and
version; the page turns two snapshots into rates and windowed percentiles (as Prometheus'
`rate` and `histogram_quantile` would). The models table is TF Serving's GetModelStatus JSON
for every model, plus its version labels.
"""

from __future__ import annotations

import time
from collections import defaultdict

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from tensorflow_serving.apis import model_pb2

from tokenserve.errors import TokenserveError
from tokenserve.server.tfserving.model_info import model_status

QUEUE_FULL_REASON = "queue_full"
"""The rejection reason answered with HTTP 429; every other reason is a refusal (4xx)."""

_GAUGES = {"vllm:num_requests_running": "num_running",
           "vllm:num_requests_waiting": "num_waiting"}
_COUNTERS = {"vllm:generation_tokens": "num_generation_tokens",
             "vllm:prompt_tokens": "num_prompt_tokens",
             "vllm:prefix_cache_queries": "num_prefix_cache_queries",
             "vllm:prefix_cache_hits": "num_prefix_cache_hits"}
_HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft",
               "vllm:inter_token_latency_seconds": "itl"}


def metrics_snapshot(registry) -> dict:
    """The dashboard's numbers from a Prometheus registry, summed over models and versions.

    Returns:
        num_running, num_waiting, kv_cache_usage (the fullest engine's, 0..1, None before any
        step), the cumulative counters in _COUNTERS, `rejected` and `finished` (counts by
        reason), and ttft/itl as {"le": [edges], "counts": [cumulative counts]}.
    """
    snapshot: dict = {name: 0.0 for name in (*_GAUGES.values(), *_COUNTERS.values())}
    snapshot["kv_cache_usage"] = None
    rejected: dict[str, float] = defaultdict(float)
    finished: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = {key: defaultdict(float)
                                             for key in _HISTOGRAMS.values()}
    for family in registry.collect():
        for sample in family.samples:
            if family.name in _GAUGES:
                snapshot[_GAUGES[family.name]] += sample.value
            elif family.name == "vllm:kv_cache_usage_perc":
                snapshot["kv_cache_usage"] = max(snapshot["kv_cache_usage"] or 0.0, sample.value)
            elif family.name in _COUNTERS and sample.name.endswith("_total"):
                snapshot[_COUNTERS[family.name]] += sample.value
            elif family.name == "tokenserve:rejected_requests" and sample.name.endswith("_total"):
                rejected[sample.labels["reason"]] += sample.value
            elif family.name == "vllm:request_success" and sample.name.endswith("_total"):
                finished[sample.labels["finished_reason"]] += sample.value
            elif family.name in _HISTOGRAMS and sample.name.endswith("_bucket"):
                buckets[_HISTOGRAMS[family.name]][float(sample.labels["le"])] += sample.value
    snapshot["rejected"], snapshot["finished"] = dict(rejected), dict(finished)
    for key, counts in buckets.items():
        edges = sorted(counts)
        snapshot[key] = {"le": [edge if edge != float("inf") else "+Inf" for edge in edges],
                         "counts": [counts[edge] for edge in edges]}
    return snapshot


def models_table(manager) -> list[dict]:
    """Every model: its GetModelStatus response as TF Serving's REST API prints it, and its
    version labels (label -> version)."""
    table = []
    for name in manager.model_names():
        try:
            status = model_status(manager, model_pb2.ModelSpec(name=name))
        except TokenserveError as error:  # configured, but no version discovered yet
            versions, reason = [], str(error)
        else:
            versions = json_format.MessageToDict(
                status, preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True)["model_version_status"]
            reason = ""
        table.append({"name": name, "model_version_status": versions,
                      "labels": {label: str(version)
                                 for label, version in sorted(manager.labels(name).items())},
                      "error": reason})
    return table


def stats_router(manager, registry) -> APIRouter:
    """The router of GET /ui/api/stats (kept out of /openapi.json: it is the page's, not a
    public API)."""
    router = APIRouter()

    @router.get("/ui/api/stats", include_in_schema=False)
    def stats() -> JSONResponse:  # sync: FastAPI runs it off the event loop (it takes locks)
        return JSONResponse({"time": time.time(), "metrics": metrics_snapshot(registry),
                             "models": models_table(manager)})

    return router
