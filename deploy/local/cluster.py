"""A local tokenserve cluster from real parts, on loopback.

Debian's `redis-server` and `prometheus`, N `tokenserve serve` replicas (the built-in model,
the Kubernetes ConfigMaps' model, batching and monitoring configs), and nginx with
deploy/nginx/nginx.conf, each config rendered for loopback by configs.py. Run by
deploy/local/up.sh, which installs the programs first, and used by
tests/deploy/test_deploy_*.py:

    python -m deploy.local.cluster --replicas 3   # from the repository root; up until Ctrl-C

It prints the gateway's ports, the replicas' and where their logs are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from deploy.local.configs import (CANARY_MODELS_CONFIG, K8S_CONFIG, local_models_config,
                                  render_nginx, render_prometheus, render_upstreams)
from tokenserve.host.ports import free_port

READY_TIMEOUT_S = 240.0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies, so a
    killed test run leaves no cluster behind (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def tokenserve_bin() -> str:
    return str(Path(sys.executable).with_name("tokenserve"))


def serve_flags() -> str:
    """`tokenserve serve --help`, to find optional flags (state and KV stores)."""
    return subprocess.run([tokenserve_bin(), "serve", "--help"], capture_output=True,
                          text=True, timeout=60).stdout


@dataclass
class Replica:
    """One `tokenserve serve` process and its three ports."""

    name: str
    release: str  # stable | canary
    models_config: Path
    grpc_port: int = field(default_factory=free_port)
    rest_port: int = field(default_factory=free_port)
    openai_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def start(self, run_dir: Path, redis_url: str | None, flags: str) -> None:
        args = [tokenserve_bin(), "serve", "--host", "127.0.0.1",
                f"--port={self.grpc_port}", f"--rest_api_port={self.rest_port}",
                f"--openai_port={self.openai_port}",
                f"--model_config_file={self.models_config}",
                "--enable_batching", f"--batching_parameters_file={K8S_CONFIG / 'batching.config'}",
                f"--monitoring_config_file={K8S_CONFIG / 'monitoring.config'}",
                "--file_system_poll_wait_seconds=0",
                # 3 replicas share 2 cores here: one intra-op thread each (inter-op stays at
                # TensorFlow's default: with 1, warmup through the batching session can hang)
                "--tensorflow_intra_op_parallelism=1"]
        if redis_url and "--state_store" in flags:
            args.append(f"--state_store={redis_url}")
        if redis_url and "--kv_store" in flags:
            args.append(f"--kv_store={redis_url[:-1]}1")  # its own database
        log = open(run_dir / f"{self.name}.log", "ab")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=_die_with_parent)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.openai_url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def terminate(self, timeout_s: float = 90) -> int:
        """SIGTERM, as Kubernetes sends after preStop; waits for the drain and exit."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)


def model_repository(root: Path) -> Path:
    """`root/builtin/{1,2}`: the built-in export as two versions (stable and canary)."""
    from tokenserve.export.cached_exports import builtin_export

    exported = builtin_export() / "1"
    base = root / "builtin"
    for version in ("1", "2"):
        (base / version).parent.mkdir(parents=True, exist_ok=True)
        if not (base / version).exists():
            (base / version).symlink_to(exported, target_is_directory=True)
    return base


class Cluster:
    """Redis, Prometheus, replicas and nginx on loopback; `with Cluster(...) as c:`."""

    def __init__(self, num_stable: int = 3, num_canary: int = 0, canary_percent: int = 0,
                 run_dir: Path | None = None, prometheus: bool = True):
        self._temp = None if run_dir else tempfile.TemporaryDirectory(prefix="tokenserve-")
        self.run_dir = Path(run_dir or self._temp.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.canary_percent = canary_percent
        self.with_prometheus = prometheus
        base = model_repository(self.run_dir / "models")
        stable_config = local_models_config(K8S_CONFIG / "models.config", base,
                                            self.run_dir / "models-stable.config")
        canary_config = local_models_config(CANARY_MODELS_CONFIG, base,
                                            self.run_dir / "models-canary.config")
        self.stable = [Replica(f"tokenserve-{i}", "stable", stable_config)
                       for i in range(num_stable)]
        self.canary = [Replica(f"tokenserve-canary-{i}", "canary", canary_config)
                       for i in range(num_canary)]
        self.redis_port, self.prometheus_port = free_port(), free_port()
        self.openai_port, self.rest_port, self.grpc_port = free_port(), free_port(), free_port()
        self.processes: list[subprocess.Popen] = []
        self.flags = ""
        self.drained: set[str] = set()

    @property
    def replicas(self) -> list[Replica]:
        return self.stable + self.canary

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def replica_at(self, upstream_addr: str) -> Replica | None:
        """The replica behind an `X-Tokenserve-Upstream` value (its last address)."""
        port = int(upstream_addr.split(",")[-1].strip().rsplit(":", 1)[1])
        return next((r for r in self.replicas if port in (r.openai_port, r.rest_port,
                                                          r.grpc_port)), None)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "ab")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=self.run_dir, start_new_session=True,
                                   preexec_fn=_die_with_parent)
        self.processes.append(process)
        return process

    def start(self) -> "Cluster":
        self.flags = serve_flags()
        self._spawn("redis", ["redis-server", "--bind", "127.0.0.1", "--port",
                              str(self.redis_port), "--save", "", "--appendonly", "no",
                              "--dir", str(self.run_dir)])
        # The first replica alone, then the rest: a cold start fills the per-user caches
        # (exported model, compiled ops, XLA programs) once instead of three times at once.
        first, *rest = self.replicas
        first.start(self.run_dir, self.redis_url, self.flags)
        self.wait_ready([first])
        for replica in rest:
            replica.start(self.run_dir, self.redis_url, self.flags)
        if self.with_prometheus:
            (self.run_dir / "prometheus.yml").write_text(
                yaml.safe_dump(render_prometheus(self.replicas)))
            self._spawn("prometheus", [
                "prometheus", f"--config.file={self.run_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.run_dir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}"])
        self.write_nginx_config()
        self._spawn("nginx", ["nginx", "-p", str(self.run_dir / "nginx"), "-c",
                              str(self.run_dir / "nginx" / "nginx.conf"), "-e", "stderr",
                              "-g", "daemon off;"])
        self.wait_ready(self.replicas)
        self._wait(lambda: self._get(f"{self.openai_url}/health"), "nginx")
        if self.with_prometheus:
            self._wait(lambda: self._get(f"{self.prometheus_url}/-/ready"), "prometheus")
        return self

    def write_nginx_config(self) -> None:
        conf_dir = self.run_dir / "nginx"
        conf_dir.mkdir(exist_ok=True)
        (conf_dir / "nginx.conf").write_text(
            render_nginx(self.openai_port, self.rest_port, self.grpc_port))
        (conf_dir / "upstreams.conf").write_text(
            render_upstreams(self.stable, self.canary, self.canary_percent,
                             frozenset(self.drained)))

    def reload_nginx(self) -> None:
        """Rewrites upstreams.conf and reloads nginx: new requests follow the new config,
        requests in flight finish on the old workers."""
        self.write_nginx_config()
        conf_dir = self.run_dir / "nginx"
        subprocess.run(["nginx", "-p", str(conf_dir), "-c", str(conf_dir / "nginx.conf"),
                        "-e", "stderr", "-s", "reload"], check=True, capture_output=True,
                       timeout=30)

    def drain(self, replica: Replica) -> None:
        """Takes a replica out of the gateway, as Kubernetes takes a terminating pod out of
        its Service while preStop runs."""
        self.drained.add(replica.name)
        self.reload_nginx()

    def undrain(self, replica: Replica) -> None:
        self.drained.discard(replica.name)
        self.reload_nginx()

    def wait_ready(self, replicas: list[Replica], timeout_s: float = READY_TIMEOUT_S) -> None:
        for replica in replicas:
            def ready(r=replica) -> bool:
                if not r.alive():
                    raise RuntimeError(f"{r.name} exited; see {self.run_dir / r.name}.log")
                return r.ready()
            self._wait(ready, replica.name, timeout_s)

    def restart(self, replica: Replica) -> None:
        """Starts a stopped replica again on its ports and waits until it is ready."""
        replica.start(self.run_dir, self.redis_url, self.flags)
        self.wait_ready([replica])

    @staticmethod
    def _get(url: str) -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @staticmethod
    def _wait(check, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")
            time.sleep(0.25)

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.alive():
                replica.process.send_signal(signal.SIGKILL)
                replica.process.wait(30)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
            if process.poll() is None:
                process.kill()
                process.wait(10)
        if self._temp is not None:
            self._temp.cleanup()

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def missing_parts() -> list[str]:
    """The programs a cluster needs that are not installed."""
    return [name for name in ("redis-server", "prometheus", "nginx") if shutil.which(name) is None]


def main() -> int:
    parser = argparse.ArgumentParser(description="a local tokenserve cluster on loopback")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--canary", type=int, default=0, help="canary replicas (version 2)")
    parser.add_argument("--canary_percent", type=int, default=10)
    parser.add_argument("--run_dir", default=None, help="logs and configs (default: a temp dir)")
    args = parser.parse_args()
    if missing_parts():
        print(f"missing: {', '.join(missing_parts())} (deploy/local/up.sh and scripts/test.sh install "
              f"them)", file=sys.stderr)
        return 1
    cluster = Cluster(args.replicas, args.canary, args.canary_percent if args.canary else 0,
                      Path(args.run_dir) if args.run_dir else None)
    with cluster:
        print(f"gateway   OpenAI {cluster.openai_url}/v1   REST {cluster.rest_url}   "
              f"gRPC 127.0.0.1:{cluster.grpc_port}")
        print(f"prometheus {cluster.prometheus_url}   redis {cluster.redis_url}")
        for r in cluster.replicas:
            print(f"{r.name:22s} {r.release:6s} OpenAI :{r.openai_port}  REST :{r.rest_port}  "
                  f"gRPC :{r.grpc_port}  pid {r.process.pid}")
        print(f"logs and configs in {cluster.run_dir}; Ctrl-C stops everything", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
