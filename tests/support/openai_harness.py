"""A real tokenserve frontend in a subprocess for the integration tests: a tiny exported model,
the real AsyncEngine, the OpenAI app under uvicorn and the gRPC generation service, on free
loopback ports. `RealServer` is used by the OpenAI, gRPC generation and observability
integration tests. Run as a script, it is the server process.

The engine's unfinished-request count is published as a Prometheus gauge through the app's
/metrics hook, so tests can watch capacity return without reaching into the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "sk-test-key"
MODEL = "tiny"
"""Served as tiny, tiny:1 and tiny@stable."""
BUSY_MODEL = "busy"
"""A second engine whose queue admits at most 3 waiting prompt tokens (its warmup request's
size), so any longer prompt is refused at once with QueueFullError: the 429 rows."""
SLOW_MODEL = "slow"
"""A third engine whose every step takes at least SLOW_STEP_S, so a test can leave a request
while it surely runs: on the tiny model a hundred tokens take well under a second otherwise,
and a client's short read timeout could race the request's own end."""
SLOW_STEP_S = 0.02
MAX_BODY_BYTES = 64 * 1024


def export_tiny_model(base: Path) -> Path:
    """Exports tiny-llama with the shared tiny tokenizer once per base directory."""
    # here, not at the top: run as a script (the server process) this file has only its own
    # folder on the path
    from support.tiny_models import TINY_TEXT, tiny
    from tokenserve.export.exporter import export_model
    from tokenserve.model.tokenizer import Tokenizer

    existing = sorted(p for p in base.glob("[0-9]*") if p.is_dir())
    if existing:
        return existing[-1]
    tokenizer = Tokenizer.train(TINY_TEXT, vocab_size=400)
    model, config = tiny("tiny-llama", tokenizer)
    return export_model(model, tokenizer, config, base, jit_compile=False)


_EXPORTED: dict = {}
"""Per test session: the exported model dir and the shared server."""


def tiny_model_dir(tmp_path_factory) -> Path:
    """One export per test session (module fixtures of several files share it)."""
    if "dir" not in _EXPORTED:
        _EXPORTED["dir"] = export_tiny_model(tmp_path_factory.getbasetemp() / "openai-tiny")
    return _EXPORTED["dir"]


def shared_server(pytestconfig, tmp_path_factory) -> "RealServer":
    """One server process for every module that uses it, stopped when the session ends."""
    if "server" not in _EXPORTED:
        server = RealServer(tiny_model_dir(tmp_path_factory))
        _EXPORTED["server"] = server
        pytestconfig.add_cleanup(server.close)
    return _EXPORTED["server"]


def shared_builtin_server(pytestconfig) -> "RealServer":
    """One server process of the built-in model (the default chat template, a 512-token
    context, room for tool listings) for every module that uses it, stopped when the
    session ends."""
    if "builtin_server" not in _EXPORTED:
        from tokenserve.export.cached_exports import builtin_export

        server = RealServer(builtin_export())
        _EXPORTED["builtin_server"] = server
        pytestconfig.add_cleanup(server.close)
    return _EXPORTED["builtin_server"]


class RealServer:
    """The server subprocess: `url` (OpenAI HTTP), `grpc_target`, `num_unfinished()`."""

    def __init__(self, model_dir: Path, request_timeout_s: float = 60.0):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TOKENSERVE_API_KEYS=API_KEY)
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(model_dir), str(request_timeout_s)],
            stdout=subprocess.PIPE, env=env, text=True)
        line = self.process.stdout.readline()
        if not line.startswith("READY"):
            self.process.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        ports = json.loads(line.split(" ", 1)[1])
        self.url = f"http://127.0.0.1:{ports['http']}"
        self.grpc_target = f"127.0.0.1:{ports['grpc']}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def _metric(self, prefix: str) -> float:
        text = httpx.get(self.url + "/metrics", headers=self.headers).text
        for line in text.splitlines():
            if line.startswith(prefix + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def num_unfinished(self, model: str = MODEL) -> int:
        """The engine's requests not yet finished (queued or running), from /metrics."""
        return int(self._metric(f'test_engine_unfinished_requests{{model="{model}"}}'))

    def num_finished(self, reason: str, model: str = MODEL) -> int:
        """Requests of `model`'s engine that finished with `reason` (stop, length, abort)."""
        return int(self._metric(
            f'test_engine_finished_requests_total{{model="{model}",reason="{reason}"}}'))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def _serve(model_dir: str, request_timeout_s: float) -> None:
    import socket

    import grpc
    import uvicorn
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.engine.config import EngineConfig
    from tokenserve.server.auth import APIKeys, AsyncAPIKeyInterceptor
    from tokenserve.server.grpc_generate import add_generation_service
    from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app
    from tokenserve.stats import StatsSink

    registry = CollectorRegistry()
    finished = Counter("test_engine_finished_requests", "finished requests by reason",
                       ["model", "reason"], registry=registry)

    class FinishCounter(StatsSink):
        def __init__(self, model: str):
            self.model = model

        def on_request(self, stats) -> None:
            finished.labels(self.model, stats.finish_reason).inc()

    small = dict(block_size=4, precision="float32", max_num_batched_tokens=64)
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(max_num_seqs=8, **small),
                                        stats=FinishCounter(MODEL))
    busy = AsyncEngine.from_model_dir(model_dir, EngineConfig(max_num_seqs=1,
                                                              max_queue_tokens=3, **small))
    slow = AsyncEngine.from_model_dir(model_dir, EngineConfig(max_num_seqs=2, **small),
                                      stats=FinishCounter(SLOW_MODEL))
    execute = slow.engine.execute

    def slow_execute(scheduled):
        time.sleep(SLOW_STEP_S)
        return execute(scheduled)

    slow.engine.execute = slow_execute
    gauge = Gauge("test_engine_unfinished_requests", "unfinished requests", ["model"],
                  registry=registry)
    gauge.labels(MODEL).set_function(lambda: engine.num_unfinished)
    gauge.labels(BUSY_MODEL).set_function(lambda: busy.num_unfinished)
    gauge.labels(SLOW_MODEL).set_function(lambda: slow.num_unfinished)

    keys = APIKeys.from_sources()
    models = StaticModels({MODEL: engine, BUSY_MODEL: busy, SLOW_MODEL: slow}, labels={"stable": 1})
    app = build_openai_app(models, OpenAIServerConfig(
        api_keys=keys, max_body_bytes=MAX_BODY_BYTES, request_timeout_s=request_timeout_s,
        metrics_registry=registry))

    grpc_server = grpc.aio.server(interceptors=[AsyncAPIKeyInterceptor(keys)])
    add_generation_service(grpc_server, models, api_keys=keys,
                           request_timeout_s=request_timeout_s)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started:
        await asyncio.sleep(0.01)
    print("READY " + json.dumps({"http": sock.getsockname()[1], "grpc": grpc_port}), flush=True)
    await task
    await grpc_server.stop(1)
    engine.shutdown()
    busy.shutdown()
    slow.shutdown()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], float(sys.argv[2])))
