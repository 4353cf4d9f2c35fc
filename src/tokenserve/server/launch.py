"""`tokenserve serve` in full: the TF Serving drop-in plus the LLM frontends.

Every tokenserve language-model version gets its own continuous-batching engine (a manager
extension: built after warmup, before the version is AVAILABLE, shut down after its streams
drain); every encoder version (embeddings, rerank) its own batcher, the same way. The OpenAI API (port 8000) and the streaming gRPC service (port 8500, beside TF
Serving's services) resolve model ids through the manager, so hot swaps reach them too.
With --ssl_config_file every port speaks TLS (server/tls.py).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from prometheus_client import CollectorRegistry

from tokenserve.host.python_heap import collector_paused
from tokenserve.observability.memory import (MemoryGauges, release_file_pages,
                                             release_freed_memory, resident_bytes)
from tokenserve.observability.memory import describe as describe_memory
from tokenserve.observability.stack import Observability
from tokenserve.server.auth import APIKeys, AsyncAPIKeyInterceptor, check_http_authorization
from tokenserve.server.config import LLMServeConfig, ServeConfig, engine_config_for
from tokenserve.server.http_thread import start_http
from tokenserve.server.status import http_status
from tokenserve.server.tls import SSLConfig

log = logging.getLogger("tokenserve.serve")


def run(config: ServeConfig, llm: LLMServeConfig = LLMServeConfig(), stop_event=None) -> None:
    """Serves until SIGTERM/SIGINT (or `stop_event`); see `tfserving.server.serve`."""
    with collector_paused():  # imports only: nothing here is garbage (python_heap.py)
        from tokenserve.encoder_config import ENCODER_CONFIG_FILE
        from tokenserve.engine.async_engine import AsyncEngine
        from tokenserve.engine.encoder_batch_config import EncoderBatchConfig
        from tokenserve.engine.encoder_batcher import AsyncEncoder
        from tokenserve.export.exporter import GENERATION_CONFIG_FILE
        from tokenserve.observability.profiler import add_profiler_service
        from tokenserve.server.grpc_generate import add_generation_service
        from tokenserve.server.openai import OpenAIServerConfig, build_openai_app
        from tokenserve.server.openai.lora import LoraModels
        from tokenserve.server.openai.managed_models import ManagedModels
        from tokenserve.server.tfserving.server import build_context, serve
        from tokenserve.state.response_store import open_response_store

    if llm.release_file_pages:  # TensorFlow's import-time code, before the peak of loading
        release_file_pages()
    registry = CollectorRegistry()
    observability = Observability(llm.observability, registry)
    observability.start()
    keys = APIKeys.from_sources(config.api_keys)
    engine_config = engine_config_for(config, llm.engine)
    # a language model's SavedModel Session (a second copy of the weights) waits for its
    # first TF Serving request: the engine serves from its own copy
    context = build_context(config, registry, lazy_llm_sessions=True)
    memory = MemoryGauges(registry)
    context.manager.add_observer(memory)  # drops a version's series when it unloads
    # version state, load and warmup latency series, and no series for unloaded versions
    context.manager.add_observer(observability.metrics)
    # TF Serving's request counters label configured models only (names come from clients)
    context.metrics.label_models(context.manager.model_names)
    models = ManagedModels(context.manager)
    if engine_config.max_loras:  # adapters as model ids, loaded and unloaded live
        models = LoraModels(models, llm.lora_modules)
        registry.register(models)  # per-adapter request and token counters
    tls = config.ssl_config
    interceptors = [AsyncAPIKeyInterceptor(keys)] if keys.enabled else []

    def encoder_for(version):
        """An encoder version's batcher (embeddings, rerank), warmed up."""
        started = time.monotonic()
        encoder = AsyncEncoder.from_model_dir(
            version.path, EncoderBatchConfig.from_engine_config(engine_config),
            stats=observability.sink, model_name=version.model_name,
            version=str(version.version))
        encoder.startup_seconds = {"load": time.monotonic() - started}
        memory.watch(version.model_name, str(version.version), encoder.runner.memory_bytes)
        return encoder

    def engine_for(version):
        if (version.path / "assets" / ENCODER_CONFIG_FILE).exists():
            return encoder_for(version)
        if not (version.path / "assets" / GENERATION_CONFIG_FILE).exists():
            return None  # not a tokenserve language model: TF Serving APIs only
        started = time.monotonic()
        engine = AsyncEngine.from_model_dir(version.path, engine_config,
                                            stats=observability.sink,
                                            model_name=version.model_name,
                                            version=str(version.version), start=False)
        loaded = time.monotonic()
        if isinstance(models, LoraModels) and version.model_name == models.base_model:
            # a bad --lora_modules entry fails the base model's load, with its reason
            models.check_startup_adapters(engine)
        engine.start()  # warms up: XLA programs (from the persistent cache), one request
        release_freed_memory()  # the checkpoint's read buffers, warmup's temporaries
        if llm.release_file_pages:  # TF's start-up code: mapped, counted in VmRSS, unused
            log.debug("unmapped %d MiB of start-up library pages", release_file_pages() >> 20)
        # the manager adds these to the version's load and warmup latency
        engine.startup_seconds = {"load": loaded - started,
                                  "warmup": time.monotonic() - loaded}
        observability.metrics.watch_prefix_cache(version.model_name, str(version.version),
                                                 engine.engine.prefix_cache_stats)
        runner, session = engine.engine.runner, version.servable
        while not hasattr(session, "weights_bytes") and hasattr(session, "_servable"):
            # the TF Serving wrappers around a LazySavedModelServable
            session = session._servable  # noqa: SLF001

        def memory_parts() -> dict[str, int]:
            return {**runner.memory_bytes(),
                    "savedmodel_weights": getattr(session, "weights_bytes", 0)}
        memory.watch(version.model_name, str(version.version), memory_parts)
        log.info("%s version %s engine: weights loaded in %.2fs, warmed up in %.2fs; %s",
                 version.model_name, version.version, engine.startup_seconds["load"],
                 engine.startup_seconds["warmup"],
                 describe_memory(memory_parts(), resident_bytes()))
        return engine

    def openai_frontend(ctx):
        if not config.openai_port:
            return None
        app = build_openai_app(models, OpenAIServerConfig(
            api_keys=keys, metrics_registry=ctx.registry, max_body_bytes=llm.max_body_bytes,
            request_timeout_s=llm.request_timeout_s, metrics_public=config.metrics_public,
            reasoning_parser=llm.reasoning_parser),
            stats=observability.sink, response_store=open_response_store(llm.state_store))
        if llm.ui:
            from tokenserve.server.ui import with_ui
            app = with_ui(app, ctx.manager, ctx.registry)
        server = start_http(app, config.host, config.openai_port, tls,
                            config.graceful_shutdown_seconds)
        scheme = "https" if tls is not None else "http"
        print(f"Serving the OpenAI API at {scheme}://{config.host}:{config.openai_port}/v1 ...",
              flush=True, file=sys.stderr)
        if llm.ui:
            print(f"Serving the playground and dashboard at {scheme}://{config.host}:"
                  f"{config.openai_port}/ ...", flush=True, file=sys.stderr)
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

        monitoring = config.monitoring
        open_paths = ({monitoring.prometheus_path} if config.metrics_public
                      and monitoring.prometheus_enabled else set())

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path not in open_paths:
                try:
                    check_http_authorization(keys, request.headers)
                except Exception as error:  # UnauthenticatedError: TF Serving's error body
                    return JSONResponse({"error": str(error)}, status_code=http_status(error))
            return await call_next(request)

    frontends, serve_config = [openai_frontend], config
    if tls is not None:
        # The TF Serving wiring opens plaintext ports only: with TLS its gRPC and REST
        # servers start here instead, on the same ports and with the same services.
        frontends = [_tls_grpc(config, tls, [generation_services], interceptors),
                     _tls_rest(config, tls, rest_auth), openai_frontend]
        serve_config = dataclasses.replace(config, port=0, rest_api_port=0,
                                           grpc_socket_path="")
    try:
        serve(serve_config, frontends=frontends, extensions={"engine": engine_for},
              grpc_services=[generation_services], grpc_interceptors=interceptors,
              stop_event=stop_event, context=context, rest_middleware=rest_auth)
    finally:
        observability.close()


def _tls_grpc(config: ServeConfig, tls: SSLConfig, services: list, interceptors: list):
    """A frontend: TF Serving's gRPC services plus `services` on --port over TLS (and on
    --grpc_socket_path, a local socket, without)."""
    def start(ctx):
        from tokenserve.server.tfserving.grpc_service import GrpcServerThread

        if not config.port and not config.grpc_socket_path:
            return None

        async def secure_port(grpc_server) -> None:
            if config.port:
                grpc_server.add_secure_port(f"0.0.0.0:{config.port}", tls.grpc_credentials())

        server = GrpcServerThread(ctx.manager, 0, config.grpc_socket_path,
                                  config.grpc_channel_arguments, ctx.metrics,
                                  max_workers=config.grpc_max_threads,
                                  extra_services=[*services, secure_port],
                                  interceptors=interceptors)
        print(f"Running gRPC ModelServer at {config.host}:{config.port} (TLS) ...",
              file=sys.stderr)
        return server
    return start


def _tls_rest(config: ServeConfig, tls: SSLConfig, middleware):
    """A frontend: TF Serving's REST API on --rest_api_port over TLS."""
    def start(ctx):
        from tokenserve.server.tfserving.rest import build_rest_app

        if not config.rest_api_port:
            return None
        monitoring = config.monitoring
        app = build_rest_app(ctx.manager, ctx.metrics, config.rest_api_timeout_in_ms / 1000,
                             monitoring.prometheus_path if monitoring.prometheus_enabled
                             else None, ctx.registry, cors=config.rest_api_enable_cors_support)
        middleware(app)
        server = start_http(app, config.host, config.rest_api_port, tls,
                            config.graceful_shutdown_seconds)
        print(f"Exporting HTTP/REST API at:{config.host}:{config.rest_api_port} (TLS) ...",
              file=sys.stderr)
        return _Stoppable(server)
    return start


class _Stoppable:
    def __init__(self, server):
        self.server = server

    def stop(self) -> None:
        self.server.should_exit = True
