"""gRPC: tensorflow.serving.PredictionService and ModelService with the official stubs'
servicer bases, plus grpc.health.v1, on TCP and an optional Unix socket."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (model_management_pb2, model_service_pb2_grpc,
                                     prediction_service_pb2_grpc, status_pb2)

from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import from_proto
from tokenserve.server.status import grpc_code
from tokenserve.server.tfserving import inference, model_info

log = logging.getLogger("tokenserve.tfserving")
ENTRYPOINT = "GRPC"


def _call(metrics, api: str, model_name: str, context: grpc.ServicerContext,
          work: Callable[[], object]):
    """Runs one RPC: maps errors through server/status.py and records TF Serving metrics."""
    started = time.monotonic()
    try:
        response = work()
    except Exception as error:  # noqa: BLE001 - every error becomes a status
        code = grpc_code(error)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", api)
        if metrics:
            metrics.request(model_name, api, ENTRYPOINT, code.name, time.monotonic() - started)
        context.abort(code, str(error))
    if metrics:
        metrics.request(model_name, api, ENTRYPOINT, "OK", time.monotonic() - started)
    return response


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, manager: ModelManager, metrics=None):
        self._manager = manager
        self._metrics = metrics

    def Predict(self, request, context):
        return _call(self._metrics, "predict", request.model_spec.name, context,
                     lambda: inference.predict(self._manager, request))

    def Classify(self, request, context):
        return _call(self._metrics, "classify", request.model_spec.name, context,
                     lambda: inference.classify(self._manager, request))

    def Regress(self, request, context):
        return _call(self._metrics, "regress", request.model_spec.name, context,
                     lambda: inference.regress(self._manager, request))

    def MultiInference(self, request, context):
        name = request.tasks[0].model_spec.name if request.tasks else ""
        return _call(self._metrics, "multi_inference", name, context,
                     lambda: inference.multi_inference(self._manager, request))

    def GetModelMetadata(self, request, context):
        return _call(self._metrics, "get_model_metadata", request.model_spec.name, context,
                     lambda: model_info.model_metadata(self._manager, request))


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, manager: ModelManager, on_reload: Callable[[list], None] | None = None):
        self._manager = manager
        self._on_reload = on_reload

    def GetModelStatus(self, request, context):
        return _call(None, "get_model_status", request.model_spec.name, context,
                     lambda: model_info.model_status(self._manager, request.model_spec))

    def HandleReloadConfigRequest(self, request, context):
        def reload():
            specs = from_proto(request.config)
            self._manager.apply_config(specs, wait=True)
            if self._on_reload:
                self._on_reload(specs)
            return model_management_pb2.ReloadConfigResponse(
                status=status_pb2.StatusProto(error_code=0))
        return _call(None, "reload_config", "", context, reload)


def channel_options(arguments: str) -> list[tuple[str, object]]:
    """`--grpc_channel_arguments=a=1,b=x` as grpcio options (ints where they parse)."""
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", -1),
                                         ("grpc.max_send_message_length", -1)]
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, _, value = item.partition("=")
        options.append((key.strip(), int(value) if value.strip().lstrip("-").isdigit()
                        else value.strip()))
    return options


def start_grpc_server(manager: ModelManager, port: int, socket_path: str = "",
                      channel_arguments: str = "", metrics=None, max_workers: int = 16,
                      on_reload: Callable[[list], None] | None = None,
                      extra_servicers: list[Callable[[grpc.Server], None]] | None = None
                      ) -> grpc.Server:
    """Starts the gRPC server; `port` 0 with no socket path starts none (returns None).

    `extra_servicers` are `add_*_to_server`-style callables, for services built elsewhere
    (e.g. a streaming generation service) to share the port.
    """
    if not port and not socket_path:
        return None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="grpc"),
                         options=channel_options(channel_arguments))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(manager, metrics), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(
        ModelServicer(manager, on_reload), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for service in ("tensorflow.serving.PredictionService", "tensorflow.serving.ModelService"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add in extra_servicers or []:
        add(server)
    if port:
        server.add_insecure_port(f"[::]:{port}")
    if socket_path:
        server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    server.health_servicer = health_servicer
    return server
