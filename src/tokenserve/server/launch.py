"""`tokenserve serve` in full: the TF Serving drop-in plus the LLM frontends.

Every tokenserve language-model version gets its own continuous-batching engine (a manager
extension: built after warmup, before the version is AVAILABLE, shut down after its streams
drain). The OpenAI API (port 8000) and the streaming gRPC service (port 8500, beside TF
Serving's services) resolve model ids through the manager, so hot swaps reach them too.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from tokenserve.engine.config import EngineConfig, from_batching_parameters
from tokenserve.observability.stack import Observability, ObservabilityConfig
from tokenserve.server.auth import APIKeys, AsyncAPIKeyInterceptor, check_http_authorization
from tokenserve.server.serve_config import ServeConfig
from tokenserve.server.status import http_status

log = logging.getLogger("tokenserve.serve")


@dataclass(frozen=True)
class LLMServeConfig:
    """What `tokenserve serve` adds to tensorflow_model_server's flags."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    request_timeout_s: float | None = 600.0
    """Deadline of every generation request (OpenAI API and gRPC stream)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger OpenAI request bodies get HTTP 413."""


def engine_config_for(config: ServeConfig, base: EngineConfig) -> EngineConfig:
    """Applies --batching_parameters_file to the engine (see engine.config for the mapping)."""
    if config.batching_parameters_file:
        with open(config.batching_parameters_file) as file:
            return from_batching_parameters(file.read(), base)
    return base


def run(config: ServeConfig, llm: LLMServeConfig = LLMServeConfig(), stop_event=None) -> None:
    """Serves until SIGTERM/SIGINT (or `stop_event`); see `tfserving.server.serve`."""
    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.export.exporter import GENERATION_CONFIG_FILE
    from tokenserve.observability.profiler import add_profiler_service
    from tokenserve.server.grpc_generate import add_generation_service
    from tokenserve.server.openai import OpenAIServerConfig, build_openai_app
    from tokenserve.server.openai.managed_models import ManagedModels
    from tokenserve.server.tfserving.server import _uvicorn, build_context, serve

    registry = CollectorRegistry()
    observability = Observability(llm.observability, registry)
    observability.start()
    keys = APIKeys.from_sources(config.api_keys)
    engine_config = engine_config_for(config, llm.engine)
    context = build_context(config, registry)
    models = ManagedModels(context.manager)

    def engine_for(version):
        if not (version.path / "assets" / GENERATION_CONFIG_FILE).exists():
            return None  # not a tokenserve language model: TF Serving APIs only
        return AsyncEngine.from_model_dir(version.path, engine_config, stats=observability.sink,
                                          model_name=version.model_name,
                                          version=str(version.version))

    def openai_frontend(ctx):
        if not config.openai_port:
            return None
        app = build_openai_app(models, OpenAIServerConfig(
            api_keys=keys, metrics_registry=ctx.registry, max_body_bytes=llm.max_body_bytes,
            request_timeout_s=llm.request_timeout_s), stats=observability.sink)
        server = _uvicorn(app, config.host, config.openai_port)
        print(f"Serving the OpenAI API at http://{config.host}:{config.openai_port}/v1 ...",
              flush=True, file=sys.stderr)
        return _Stoppable(server)

    async def generation_services(grpc_server):
        add_generation_service(grpc_server, models, api_keys=keys,
                               request_timeout_s=llm.request_timeout_s)
        add_profiler_service(grpc_server)

    def rest_auth(app):
        if not keys.enabled:
            return
        from fastapi import Request
        from fastapi.responses import JSONResponse

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            try:
                check_http_authorization(keys, request.headers)
            except Exception as error:  # UnauthenticatedError: TF Serving's error body
                return JSONResponse({"error": str(error)}, status_code=http_status(error))
            return await call_next(request)

    try:
        serve(config, frontends=[openai_frontend], extensions={"engine": engine_for},
              grpc_services=[generation_services],
              grpc_interceptors=[AsyncAPIKeyInterceptor(keys)] if keys.enabled else [],
              stop_event=stop_event, context=context, rest_middleware=rest_auth)
    finally:
        observability.close()


class _Stoppable:
    def __init__(self, server):
        self.server = server

    def stop(self) -> None:
        self.server.should_exit = True
