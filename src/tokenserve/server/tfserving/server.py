"""Wires one server process: manager, poller, TF Serving gRPC and REST, metrics registry.

Other frontends (the OpenAI API, the streaming generation service) plug in through
`frontends`: callables that get the `ServeContext` once every model has loaded and return an
object with `stop()`.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import CollectorRegistry

from tokenserve.lifecycle.batching import BatchingServable
from tokenserve.lifecycle.servable_loader import load_servable
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import read_model_config_file
from tokenserve.lifecycle.poller import Poller
from tokenserve.lifecycle.session_bundle import SessionOptions
from tokenserve.lifecycle.warmup_replay import make_warmup
from tokenserve.observability.tfserving_metrics import TFServingMetrics
from tokenserve.server.config import ServeConfig
from tokenserve.server.http_thread import start_http
from tokenserve.server.tfserving.grpc_service import start_grpc_server
from tokenserve.server.tfserving.inference import set_signature_method_name_check
from tokenserve.server.tfserving.rest import build_rest_app
from tokenserve.server.tfserving.warmup import replay_warmup_record

log = logging.getLogger("tokenserve.serve")


@dataclass
class ServeContext:
    """What a frontend needs: the config, the manager (acquire(), available_versions(),
    labels(), register_extension()) and the Prometheus registry to add metrics to."""

    config: ServeConfig
    manager: ModelManager
    registry: CollectorRegistry
    metrics: TFServingMetrics
    stoppables: list = field(default_factory=list)


Frontend = Callable[[ServeContext], object]


class _TimedServable:
    """Records `:tensorflow:serving:runtime_latency` around every signature run."""

    def __init__(self, servable, model_name: str, metrics: TFServingMetrics):
        self._servable = servable
        self._model_name = model_name
        self._metrics = metrics
        self.path = servable.path
        self.signature_defs = servable.signature_defs

    def run(self, signature_name, inputs, output_keys=None, timeout_s=None):
        started = time.monotonic()
        try:
            return self._servable.run(signature_name, inputs, output_keys, timeout_s)
        finally:
            self._metrics.runtime(self._model_name, "predict", time.monotonic() - started)

    def close(self) -> None:
        self._servable.close()


def build_context(config: ServeConfig, registry: CollectorRegistry | None = None,
                  lazy_llm_sessions: bool = False) -> ServeContext:
    """A manager configured from `config` (nothing loaded yet) and a registry (a fresh one
    unless given). `lazy_llm_sessions`: a tokenserve language model's SavedModel Session (a
    second copy of the weights the engine already holds) is built on its first TF Serving
    request, and its TF Serving warmup records wait for that too."""
    from tokenserve.encoder_config import ENCODER_CONFIG_FILE
    from tokenserve.export.exporter import GENERATION_CONFIG_FILE

    registry = registry if registry is not None else CollectorRegistry()
    metrics = TFServingMetrics(registry)
    set_signature_method_name_check(config.enable_signature_method_name_check)
    replay = (make_warmup(replay_warmup_record, config.num_request_iterations_for_warmup)
              if config.enable_model_warmup else None)
    session_options = SessionOptions(intra_op_threads=config.intra_op_threads,
                                     inter_op_threads=config.inter_op_threads)

    def lazy(path) -> bool:
        assets = path / "assets"
        return lazy_llm_sessions and ((assets / GENERATION_CONFIG_FILE).exists()
                                      or (assets / ENCODER_CONFIG_FILE).exists())

    def warmup(version):
        if lazy(version.path):
            log.info("%s version %d: TF Serving warmup skipped (its Session is built on the "
                     "first TF Serving request; the engine warms up itself)",
                     version.model_name, version.version)
            return
        replay(version)

    def load(spec, path):
        servable = load_servable(spec, path, prefer_tflite=config.prefer_tflite_model,
                                 tags=config.tags, session_options=session_options,
                                 lazy_session=lazy(path))
        servable = _TimedServable(servable, spec.name, metrics)
        if config.enable_batching:
            servable = BatchingServable(servable, config.batching_parameters)
        return servable

    manager = ModelManager(
        load, warmup=warmup if replay is not None else None, max_num_load_retries=config.max_num_load_retries,
        load_retry_interval_s=config.load_retry_interval_micros / 1e6,
        allow_labels_for_unavailable=config.allow_version_labels_for_unavailable_models,
        metrics=metrics)
    return ServeContext(config, manager, registry, metrics)


def _tensorflow_threads(config: ServeConfig) -> None:
    """--tensorflow_*_parallelism, set before any model loads (TF fixes them on first use)."""
    if not (config.intra_op_threads or config.inter_op_threads):
        return
    import tensorflow as tf

    if config.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(config.intra_op_threads)
    if config.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads)


def serve(config: ServeConfig, frontends: list[Frontend] = (),
          extensions: dict[str, Callable] | None = None, grpc_services: list[Callable] = (),
          grpc_interceptors: list = (), stop_event: threading.Event | None = None,
          context: ServeContext | None = None, rest_middleware: Callable | None = None) -> None:
    """Loads every model, starts gRPC and REST (and `frontends`), serves until SIGTERM/SIGINT
    or `stop_event`, then stops accepting, drains in-flight requests and unloads.

    Args:
        config: the server's configuration.
        frontends: `(ServeContext) -> object with stop()`, started after models load.
        extensions: name -> factory, registered on the manager before anything loads
            (`version.extensions[name]`, e.g. an engine per version).
        grpc_services: `async (grpc.aio.Server) -> None`, to add services on port 8500.
        grpc_interceptors: grpc.aio server interceptors (e.g. API-key auth).
        stop_event: stops the server when set (tests, embedding).
        context: a context made by `build_context` (to share its manager beforehand).
        rest_middleware: `(FastAPI app) -> None`, applied to the REST app (e.g. API keys).
    """
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenserve").setLevel(logging.INFO)  # lifecycle events, not TF's INFO
    _tensorflow_threads(config)
    context = context or build_context(config)
    manager = context.manager
    for name, factory in (extensions or {}).items():
        manager.register_extension(name, factory)
    manager.apply_config(config.model_specs(), wait=True)
    read_config = (partial(read_model_config_file, config.model_config_file)
                   if config.model_config_file else None)
    poller = Poller(manager, config.file_system_poll_wait_seconds, read_config,
                    config.model_config_file_poll_wait_seconds)
    poller.start()
    grpc_server = start_grpc_server(manager, config.port, config.grpc_socket_path,
                                    config.grpc_channel_arguments, context.metrics,
                                    max_workers=config.grpc_max_threads,
                                    extra_services=grpc_services,
                                    interceptors=grpc_interceptors)
    if grpc_server is not None:
        print(f"Running gRPC ModelServer at {config.host}:{config.port} ...", file=sys.stderr)
    http_servers = []
    if config.rest_api_port:
        monitoring = config.monitoring
        app = build_rest_app(manager, context.metrics, config.rest_api_timeout_in_ms / 1000,
                             monitoring.prometheus_path if monitoring.prometheus_enabled
                             else None, context.registry,
                             cors=config.rest_api_enable_cors_support)
        if rest_middleware is not None:
            rest_middleware(app)
        http_servers.append(start_http(app, config.host, config.rest_api_port,
                                       graceful_shutdown_s=None))
        print(f"Exporting HTTP/REST API at:{config.host}:{config.rest_api_port} ...",
              file=sys.stderr)
    for frontend in frontends:
        context.stoppables.append(frontend(context))
    sys.stderr.flush()

    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    for server in http_servers:
        server.should_exit = True
    for stoppable in context.stoppables:
        if hasattr(stoppable, "stop"):
            stoppable.stop()
    if grpc_server is not None:
        grpc_server.stop(grace_s=5)
    poller.stop()
    manager.close(timeout_s=30)
