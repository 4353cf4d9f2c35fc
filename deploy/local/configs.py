"""The deploy/ configs, rendered for a cluster on loopback (deploy/local/cluster.py).

What differs from Kubernetes, each on purpose: nginx's `listen` lines move to free loopback
ports and `upstreams.conf` lists the replicas' ports (`render_upstreams`); Prometheus' job
gets static targets labelled like pods (`render_prometheus`); the model configs'
`base_path` points at a local model repository (`local_models_config`). Each renderer
reads the file the Kubernetes manifests use, so the cluster runs the same configs.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
K8S_CONFIG = DEPLOY / "k8s" / "base" / "config"
CANARY_MODELS_CONFIG = DEPLOY / "k8s" / "overlays" / "canary" / "models.config"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ADAPTER_RULES = DEPLOY / "prometheus" / "adapter-rules.yaml"
NAMESPACE = "local"


def render_upstreams(stable: list, canary: list, canary_percent: int,
                     drained: frozenset[str] = frozenset()) -> str:
    """upstreams.conf for the local cluster: the blocks deploy/nginx/upstreams.conf defines,
    with loopback ports for servers (the replicas' `openai_port`, `rest_port`, `grpc_port`;
    cluster.Replica). With no canary replicas, canary names the stable ones.
    Replicas named in `drained` are marked `down`, as a pod leaves its Service's endpoints
    when it starts terminating."""
    canary = canary or stable
    split = (f"split_clients $split_key $release {{\n    {canary_percent}% canary;\n"
             f"    * stable;\n}}\n") if canary_percent else (
        "split_clients $split_key $release {\n    * stable;\n}\n")
    blocks = [split]
    for suffix, group in (("", stable), ("_canary", canary)):
        for pool, balance, port in (("openai", "least_conn", "openai_port"),
                                    ("openai_affinity", "hash $affinity_key consistent",
                                     "openai_port"),
                                    ("rest", "least_conn", "rest_port"),
                                    ("grpc", "least_conn", "grpc_port")):
            name = f"tokenserve_{pool.replace('openai_affinity', 'openai')}{suffix}"
            if pool == "openai_affinity":
                name += "_affinity"
            servers = "".join(f"    server 127.0.0.1:{getattr(r, port)} max_fails=1 "
                              f"fail_timeout=5s{' down' if r.name in drained else ''};\n"
                              for r in group)
            blocks.append(f"upstream {name} {{\n    zone {name} 64k;\n    {balance};\n"
                          f"{servers}}}\n")
    return "\n".join(blocks)


def render_nginx(openai_port: int, rest_port: int, grpc_port: int) -> str:
    """deploy/nginx/nginx.conf with its three `listen` lines on loopback ports."""
    text = NGINX_CONF.read_text()
    for old, new in (("listen 8000;", f"listen 127.0.0.1:{openai_port};"),
                     ("listen 8501;", f"listen 127.0.0.1:{rest_port};"),
                     ("listen 8500 http2;", f"listen 127.0.0.1:{grpc_port} http2;")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def render_prometheus(replicas: list) -> dict:
    """deploy/prometheus/prometheus.yml's job with static targets labelled like pods (the
    replicas' `openai_port`, `name` and `release`; cluster.Replica)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tokenserve")
    job.pop("kubernetes_sd_configs")
    job.pop("relabel_configs")
    job["static_configs"] = [
        {"targets": [f"127.0.0.1:{r.openai_port}"],
         "labels": {"namespace": NAMESPACE, "pod": r.name, "release": r.release}}
        for r in replicas]
    return config


def adapter_query(pods: list[str]) -> str:
    """The adapter rule's metricsQuery as prometheus-adapter fills it in for one HPA: the
    series, the pods' namespace and names as label matchers, grouped by pod."""
    rule = yaml.safe_load(ADAPTER_RULES.read_text())["rules"][0]
    series = re.search(r"^[^{]+", rule["seriesQuery"]).group(0)
    matchers = f'namespace="{NAMESPACE}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


def local_models_config(source: Path, base_path: Path, out: Path) -> Path:
    """A Kubernetes models.config with `base_path` pointing at the local repository."""
    text = re.sub(r'base_path: "[^"]*"', f'base_path: "{base_path}"', source.read_text())
    out.write_text(text)
    return out
