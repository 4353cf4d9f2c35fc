"""The shipped Grafana dashboard queries only series that LLMMetrics exports."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from support.paths import REPO_ROOT
from tokenserve.observability.llm_metrics import LLMMetrics

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tokenserve.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_series() -> set[str]:
    registry = CollectorRegistry()
    LLMMetrics(registry)
    return {family.name + suffix for family in registry.collect()
            for suffix in SUFFIXES[family.type]}


def test_every_dashboard_query_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"]
                   for target in panel.get("targets", [])]
    assert len(expressions) >= 20
    used = {name for expr in expressions
            for name in re.findall(r"\b(?:vllm|tokenserve):[A-Za-z0-9_:]+", expr)}
    assert used - exported_series() == set()
    # the panels the issue asks for are there
    for required in ("vllm:time_to_first_token_seconds_bucket",
                     "vllm:inter_token_latency_seconds_bucket",
                     "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total",
                     "vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "tokenserve:batch_size_bucket",
                     "vllm:num_preemptions_total", "tokenserve:rejected_requests_total"):
        assert required in used, required
    assert sum("histogram_quantile" in expr for expr in expressions) >= 9
