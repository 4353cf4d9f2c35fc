"""The container image: its Dockerfile says what the deployment needs, and its entrypoint
script really serves.

No container registry is reachable from these machines, so the image itself is not built
here; the entrypoint script runs as the image runs it, against this checkout's .venv.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deploy.local.cluster import free_port
from deploy.local.configs import DEPLOY

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_is_slim_nonroot_and_serves_the_three_ports():
    steps = instructions()
    bases = [args.split()[0] for op, args in steps if op == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases)
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    user = [args for op, args in final if op == "USER"]
    assert user and user[-1] not in ("root", "0")
    exposed = {int(p) for op, args in final if op == "EXPOSE" for p in args.split()}
    assert exposed == {8500, 8501, 8000}
    health = next(args for op, args in final if op == "HEALTHCHECK")
    assert "/health" in health and "8000" in health
    assert any(op == "ENTRYPOINT" and "tokenserve-entrypoint" in args for op, args in final)
    # the built-in model is exported at build time where the entrypoint looks by default
    assert any(op == "RUN" and "tokenserve export --output /models/builtin" in args
               for op, args in steps)
    env = " ".join(args for op, args in final if op == "ENV")
    assert "MODEL_NAME=builtin" in env and "MODEL_BASE_PATH=/models" in env


def run_entrypoint(*args: str, env: dict | None = None, **kwargs):
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.Popen(["sh", str(ENTRYPOINT), *args], env={**os.environ, "PATH": path,
                                                                 **(env or {})}, **kwargs)


def test_entrypoint_passes_other_commands_through():
    process = run_entrypoint("echo", "hello", stdout=subprocess.PIPE, text=True)
    assert process.communicate(timeout=30)[0] == "hello\n"
    version = run_entrypoint("--version", stdout=subprocess.PIPE, text=True)
    assert "TensorFlow ModelServer: tokenserve" in version.communicate(timeout=120)[0]


def test_entrypoint_serves_model_name_under_model_base_path(tmp_path):
    """TF Serving's habit: MODEL_NAME under MODEL_BASE_PATH, extra flags after the image."""
    from tokenserve.export.cached_exports import builtin_export

    (tmp_path / "code").symlink_to(builtin_export(), target_is_directory=True)
    openai, rest, grpc_port = free_port(), free_port(), free_port()
    log = open(tmp_path / "serve.log", "wb")
    process = run_entrypoint(f"--port={grpc_port}", f"--rest_api_port={rest}",
                             f"--openai_port={openai}", "--host=127.0.0.1",
                             env={"MODEL_NAME": "code", "MODEL_BASE_PATH": str(tmp_path),
                                  "TF_CPP_MIN_LOG_LEVEL": "3"},
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{openai}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not ready in 240 s"
            time.sleep(0.5)
        status = httpx.get(f"http://127.0.0.1:{rest}/v1/models/code", timeout=10).json()
        assert status["model_version_status"][0]["state"] == "AVAILABLE"
        assert httpx.get(f"http://127.0.0.1:{openai}/health", timeout=10).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(120)
    assert exit_code == 0  # the shell exec'd tokenserve: SIGTERM reached it and it drained
