"""Rollouts on a real local cluster (deploy/local/cluster.py), with counts.

- Rolling restart: each replica in turn leaves the gateway (as a terminating pod leaves its
  Service while preStop sleeps; here by an nginx reload), gets SIGTERM, drains its streams,
  exits, starts again and rejoins, all under streaming load: zero failed requests.
- Canary at 10 %: two stable replicas (version 1, label `stable`), one canary (version 2,
  label `canary`); over 1,000 unpinned requests the canary's share is within 3 points of
  10 %, and requests pinned to @stable or @canary (OpenAI model id, REST label path, the
  gateway's release header on gRPC) always reach their version.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from deploy.local.cluster import Cluster, missing_parts
from support.cluster_load import Load, completions_task

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing_parts()),
                                 reason=f"needs {', '.join(missing_parts())} (scripts/setup.sh)")]

NUM_STREAMS = 6
PRE_STOP_S = 0.2  # the local stand-in for preStop: short, so SIGTERM meets open streams
NUM_SPLIT_REQUESTS = 1000
CANARY_PERCENT = 10
NUM_PINNED = 25


def test_rolling_restart_by_sigterm_fails_no_request():
    with Cluster(num_stable=3, prometheus=False) as cluster:
        # long streams, so that several are in flight on a replica when it gets SIGTERM
        load = Load(cluster.openai_url, NUM_STREAMS, completions_task(max_tokens=256),
                    keepalive=False).start()
        time.sleep(3)
        draining = []  # (replica, SIGTERM time)
        for replica in cluster.stable:
            cluster.drain(replica)
            time.sleep(PRE_STOP_S)
            draining.append((replica, time.monotonic()))
            exit_code = replica.terminate()
            assert exit_code == 0, f"{replica.name} exited with {exit_code}"
            cluster.restart(replica)
            cluster.undrain(replica)
            time.sleep(2)
        outcomes = load.stop()
    failed = [o for o in outcomes if not o.ok]
    drained_streams = sum(
        1 for replica, sigterm in draining for o in outcomes
        if o.started < sigterm < o.ended and cluster.replica_at(o.upstream) is replica)
    print(f"\nrolling restart of 3 replicas under {NUM_STREAMS} streams: {len(outcomes)} "
          f"requests, {len(failed)} failed, {drained_streams} streams in flight at a SIGTERM "
          f"(drained to completion)")
    assert len(outcomes) > 3 * NUM_STREAMS
    assert not failed, [(o.upstream, o.status, o.error) for o in failed]
    assert drained_streams >= 1, "no stream was open at any SIGTERM: the drain went untested"


def model_status_version(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["model_version_status"][0]["version"])


def grpc_status_version(channel, release: str) -> int:
    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "builtin"
    request.model_spec.version_label = release
    reply = stub.GetModelStatus(request, timeout=10,
                                metadata=[("x-tokenserve-release", release)])
    return reply.model_version_status[0].version


@pytest.fixture(scope="module")
def canary_cluster():
    with Cluster(num_stable=2, num_canary=1, canary_percent=CANARY_PERCENT,
                 prometheus=False) as cluster:
        yield cluster


def test_canary_split_is_ten_percent_over_1000_requests(canary_cluster):
    versions = {1: 0, 2: 0}
    with httpx.Client(base_url=canary_cluster.rest_url, timeout=30) as client:
        for _ in range(NUM_SPLIT_REQUESTS):
            versions[model_status_version(client.get("/v1/models/builtin"))] += 1
    share = 100 * versions[2] / NUM_SPLIT_REQUESTS
    print(f"\ncanary split over {NUM_SPLIT_REQUESTS} unpinned requests: version 1 (stable) "
          f"{versions[1]}, version 2 (canary) {versions[2]} = {share:.1f} %")
    assert abs(share - CANARY_PERCENT) <= 3


def test_unpinned_generation_is_served_by_both_releases(canary_cluster):
    releases = set()
    with httpx.Client(base_url=canary_cluster.openai_url, timeout=60) as client:
        for i in range(60):
            response = client.post("/v1/completions", json={
                "model": "builtin", "prompt": f"x = {i}", "max_tokens": 2})
            assert response.status_code == 200, response.text
            releases.add(canary_cluster.replica_at(
                response.headers["x-tokenserve-upstream"]).release)
    assert releases == {"stable", "canary"}


@pytest.mark.parametrize("release,version", [("stable", 1), ("canary", 2)])
def test_pinned_requests_always_reach_their_version(canary_cluster, release, version):
    counts = {"openai": 0, "rest": 0, "rest_header": 0, "grpc": 0}
    with httpx.Client(timeout=60) as client:
        for i in range(NUM_PINNED):
            response = client.post(f"{canary_cluster.openai_url}/v1/completions", json={
                "model": f"builtin@{release}", "prompt": f"y = {i}", "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == f"builtin@{release}"
            replica = canary_cluster.replica_at(response.headers["x-tokenserve-upstream"])
            assert replica.release == release
            counts["openai"] += 1
            rest = client.get(f"{canary_cluster.rest_url}/v1/models/builtin/labels/{release}")
            assert model_status_version(rest) == version
            counts["rest"] += 1
            pinned = client.get(f"{canary_cluster.rest_url}/v1/models/builtin",
                                headers={"X-Tokenserve-Release": release})
            assert model_status_version(pinned) == version
            counts["rest_header"] += 1
    with grpc.insecure_channel(f"127.0.0.1:{canary_cluster.grpc_port}") as channel:
        for _ in range(NUM_PINNED):
            assert grpc_status_version(channel, release) == version
            counts["grpc"] += 1
    print(f"\npinned @{release}: {json.dumps(counts)} requests, all on version {version}")
