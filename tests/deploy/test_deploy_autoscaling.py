"""The autoscaling signal, end to end on a real local cluster (deploy/local/cluster.py).

Prometheus scrapes the three replicas with the manifests' scrape job; the test runs the
prometheus-adapter rule's query (deploy/prometheus/adapter-rules.yaml, filled in as the
adapter fills it for the HPA) and applies the HorizontalPodAutoscaler's formula with the
target in deploy/k8s/base/hpa.yaml. Idle, it asks for fewer replicas; under a load that
queues requests behind the batch limit (batching.config), it asks for more.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import yaml

from deploy.local.cluster import Cluster, missing_parts
from deploy.local.configs import DEPLOY, adapter_query
from support.cluster_load import Load, completions_task

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing_parts()),
                                 reason=f"needs {', '.join(missing_parts())} (scripts/setup.sh)")]

HPA = yaml.safe_load((DEPLOY / "k8s" / "base" / "hpa.yaml").read_text())["spec"]
TARGET = float(next(m for m in HPA["metrics"] if m["type"] == "Pods")
               ["pods"]["target"]["averageValue"])
TOLERANCE = 0.1  # the HPA controller's default
NUM_STREAMS = 48  # 3 replicas x max_batch_size 8 = 24 decode; the rest wait
WAIT_S = 90.0


def hpa_desired_replicas(current: int, per_pod: list[float]) -> int:
    """The HorizontalPodAutoscaler's rule for a Pods metric with an AverageValue target."""
    ratio = (sum(per_pod) / len(per_pod)) / TARGET
    desired = current if abs(ratio - 1) <= TOLERANCE else math.ceil(current * ratio)
    return max(HPA["minReplicas"], min(HPA["maxReplicas"], desired))


def per_pod_metric(cluster: Cluster) -> dict[str, float]:
    query = adapter_query([r.name for r in cluster.replicas])
    response = httpx.get(f"{cluster.prometheus_url}/api/v1/query", params={"query": query},
                         timeout=10)
    response.raise_for_status()
    return {s["metric"]["pod"]: float(s["value"][1])
            for s in response.json()["data"]["result"]}


def poll(cluster: Cluster, until) -> tuple[dict[str, float], int]:
    deadline = time.monotonic() + WAIT_S
    while True:
        values = per_pod_metric(cluster)
        desired = (hpa_desired_replicas(len(cluster.replicas), list(values.values()))
                   if len(values) == len(cluster.replicas) else None)
        if desired is not None and until(desired):
            return values, desired
        assert time.monotonic() < deadline, f"no such signal in {WAIT_S:.0f}s: {values}"
        time.sleep(2)


def test_hpa_signal_from_prometheus_asks_for_more_under_load_and_fewer_idle():
    current = 3
    with Cluster(num_stable=current) as cluster:
        # The engine's gauges appear with its first step: one request per replica makes
        # every pod report (an idle pod that never served has no series at all).
        for replica in cluster.replicas:
            httpx.post(f"{replica.openai_url}/v1/completions", timeout=60, json={
                "model": "builtin", "prompt": "a", "max_tokens": 1}).raise_for_status()
        idle, idle_desired = poll(cluster, lambda desired: desired < current)
        load = Load(cluster.openai_url, NUM_STREAMS, completions_task(max_tokens=96)).start()
        try:
            busy, busy_desired = poll(cluster, lambda desired: desired > current)
        finally:
            outcomes = load.stop()
        after, after_desired = poll(cluster, lambda desired: desired < current)
    print(f"\nautoscaling signal ({adapter_query(['...'])}), target {TARGET:g} per pod:\n"
          f"  idle   {idle} -> desired {idle_desired}\n"
          f"  load   {busy} -> desired {busy_desired} ({NUM_STREAMS} streams, "
          f"{len(outcomes)} requests, {sum(not o.ok for o in outcomes)} failed)\n"
          f"  after  {after} -> desired {after_desired}")
    assert all(o.ok for o in outcomes)
