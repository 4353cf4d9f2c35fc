"""gRPC: tensorflow.serving.PredictionService and ModelService with the official stubs'
servicer bases, plus grpc.health.v1, on TCP and an optional Unix socket.

The server is grpc.aio, so other aio services (the streaming generation service) can share
port 8500; blocking inference runs on a thread pool, never on the event loop.

Requests are decoded by tokenserve, not by grpcio: bytes that are not the RPC's request
message are INVALID_ARGUMENT, as any other bad request (grpcio would answer UNKNOWN). A
call's deadline bounds its TensorFlow run (TF Serving's enforce_session_run_timeout), so a
call that ran out of time stops computing."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2,
                                     get_model_status_pb2, inference_pb2, model_management_pb2,
                                     model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2, status_pb2)

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import from_proto
from tokenserve.server.status import grpc_details
from tokenserve.server.tfserving import inference, model_info, multi_inference
from tokenserve.server.tfserving.tf_status import error_grpc_code, error_message

log = logging.getLogger("tokenserve.tfserving")
ENTRYPOINT = "GRPC"


class _Undecodable:
    """What a request deserializer returns for bytes that are not its message."""

    def __init__(self, message_type, error: Exception):
        self.error = InvalidRequestError(f"Could not parse {message_type.DESCRIPTOR.full_name}: "
                                         f"{error}")


def _decoder(message_type):
    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as error:
            return _Undecodable(message_type, error)
    return decode


def _deadline(context) -> float | None:
    """The call's gRPC deadline as a time.monotonic() value (None without one)."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


async def _call(executor, metrics, api: str, model_name: str, context,
                work: Callable[[], object], request=None):
    """Runs one RPC's blocking work on the executor; maps errors (TF's own codes for
    TensorFlow errors, server/status.py for the rest) and records TF Serving metrics."""
    started = time.monotonic()
    try:
        if isinstance(request, _Undecodable):
            raise request.error
        response = await asyncio.get_running_loop().run_in_executor(executor, work)
    except Exception as error:  # noqa: BLE001 - every error becomes a status
        code = error_grpc_code(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", api, exc_info=error)
        if metrics and model_name:
            metrics.request(model_name, api, ENTRYPOINT, code.name, time.monotonic() - started)
        await context.abort(code, grpc_details(error_message(error)))
    if metrics:
        metrics.request(model_name, api, ENTRYPOINT, "OK", time.monotonic() - started)
    return response


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    """tensorflow.serving.PredictionService (grpc.aio; inference runs on `executor`)."""

    def __init__(self, manager: ModelManager, executor, metrics=None):
        self._manager = manager
        self._executor = executor
        self._metrics = metrics

    async def _run(self, api, request, name_of, context, work):
        name = "" if isinstance(request, _Undecodable) else name_of(request)
        deadline = _deadline(context)
        return await _call(self._executor, self._metrics, api, name, context,
                           lambda: work(deadline), request)

    async def Predict(self, request, context):
        return await self._run("Predict", request, lambda r: r.model_spec.name, context,
                               lambda deadline: inference.predict(self._manager, request,
                                                                  deadline))

    async def Classify(self, request, context):
        return await self._run("Classify", request, lambda r: r.model_spec.name, context,
                               lambda deadline: inference.classify(self._manager, request,
                                                                   deadline))

    async def Regress(self, request, context):
        return await self._run("Regress", request, lambda r: r.model_spec.name, context,
                               lambda deadline: inference.regress(self._manager, request,
                                                                  deadline))

    async def MultiInference(self, request, context):
        return await self._run(
            "MultiInference", request,
            lambda r: r.tasks[0].model_spec.name if r.tasks else "", context,
            lambda deadline: multi_inference.multi_inference(self._manager, request,
                                                             deadline))

    async def GetModelMetadata(self, request, context):
        return await self._run("GetModelMetadata", request, lambda r: r.model_spec.name,
                               context, lambda deadline: model_info.model_metadata(
                                   self._manager, request))


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """tensorflow.serving.ModelService: status and full-replacement config reload."""

    def __init__(self, manager: ModelManager, executor):
        self._manager = manager
        self._executor = executor

    async def GetModelStatus(self, request, context):
        return await _call(self._executor, None, "GetModelStatus", "", context,
                           lambda: model_info.model_status(self._manager, request.model_spec),
                           request)

    async def HandleReloadConfigRequest(self, request, context):
        def reload():
            # model_service_impl.cc: only a ModelConfigList is accepted; an empty request
            # (no config) changes nothing.
            if request.config.WhichOneof("config") != "model_config_list":
                raise InvalidRequestError(
                    "ServerModelConfig type not supported by HandleReloadConfigRequest. Only "
                    "ModelConfigList is currently supported")
            self._manager.apply_config(from_proto(request.config), wait=True)
            return model_management_pb2.ReloadConfigResponse(
                status=status_pb2.StatusProto(error_code=0))
        return await _call(self._executor, None, "HandleReloadConfigRequest", "", context,
                           reload, request)


# The servicers' methods with tokenserve's request decoders (see the module docstring).
_PREDICTION_METHODS = {
    "Classify": (classification_pb2.ClassificationRequest,
                 classification_pb2.ClassificationResponse),
    "Regress": (regression_pb2.RegressionRequest, regression_pb2.RegressionResponse),
    "Predict": (predict_pb2.PredictRequest, predict_pb2.PredictResponse),
    "MultiInference": (inference_pb2.MultiInferenceRequest,
                       inference_pb2.MultiInferenceResponse),
    "GetModelMetadata": (get_model_metadata_pb2.GetModelMetadataRequest,
                         get_model_metadata_pb2.GetModelMetadataResponse),
}
_MODEL_METHODS = {
    "GetModelStatus": (get_model_status_pb2.GetModelStatusRequest,
                       get_model_status_pb2.GetModelStatusResponse),
    "HandleReloadConfigRequest": (model_management_pb2.ReloadConfigRequest,
                                  model_management_pb2.ReloadConfigResponse),
}


def _add_servicer(server, service: str, servicer, methods: dict) -> None:
    handlers = {name: grpc.unary_unary_rpc_method_handler(
                    getattr(servicer, name), request_deserializer=_decoder(request_type),
                    response_serializer=response_type.SerializeToString)
                for name, (request_type, response_type) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def channel_options(arguments: str) -> list[tuple[str, object]]:
    """`--grpc_channel_arguments=a=1,b=x` as grpcio options (ints where they parse)."""
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", -1),
                                         ("grpc.max_send_message_length", -1)]
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, _, value = item.partition("=")
        options.append((key.strip(), int(value) if value.strip().lstrip("-").isdigit()
                        else value.strip()))
    return options


async def add_tfserving_services(server: grpc.aio.Server, manager: ModelManager,
                                 executor: futures.Executor, metrics=None
                                 ) -> health.aio.HealthServicer:
    """Adds PredictionService, ModelService and grpc.health.v1 to a grpc.aio server (one
    that may also host other services, e.g. the streaming generation service)."""
    _add_servicer(server, "tensorflow.serving.PredictionService",
                  PredictionServicer(manager, executor, metrics), _PREDICTION_METHODS)
    _add_servicer(server, "tensorflow.serving.ModelService", ModelServicer(manager, executor),
                  _MODEL_METHODS)
    health_servicer = health.aio.HealthServicer()
    for service in ("", "tensorflow.serving.PredictionService",
                    "tensorflow.serving.ModelService"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


class GrpcServerThread:
    """A grpc.aio server on its own event loop in a daemon thread.

    `extra_services` are `async (server) -> None` callables run before the server starts,
    for services built elsewhere to share the port; `interceptors` go to grpc.aio.server.
    """

    def __init__(self, manager: ModelManager, port: int, socket_path: str = "",
                 channel_arguments: str = "", metrics=None, max_workers: int = 16,
                 extra_services: list[Callable] = (), interceptors: list = ()):
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="grpc-inference")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop",
                                        daemon=True)
        self._thread.start()

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server(options=channel_options(channel_arguments),
                                     interceptors=list(interceptors) or None)
            self.health = await add_tfserving_services(server, manager, self._executor,
                                                       metrics)
            for add in extra_services:
                await add(server)
            if port:
                server.add_insecure_port(f"0.0.0.0:{port}")  # as tensorflow_model_server
            if socket_path:
                server.add_insecure_port(f"unix:{socket_path}")
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting calls, lets running ones finish for `grace_s`, ends the loop."""
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop).result(
            grace_s + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self._executor.shutdown(wait=False)


def start_grpc_server(manager: ModelManager, port: int, socket_path: str = "",
                      channel_arguments: str = "", metrics=None, max_workers: int = 16,
                      extra_services: list[Callable] = (), interceptors: list = ()
                      ) -> GrpcServerThread | None:
    """Starts the TF Serving gRPC server; None when `port` is 0 and there is no socket."""
    if not port and not socket_path:
        return None
    return GrpcServerThread(manager, port, socket_path, channel_arguments, metrics,
                            max_workers, extra_services, interceptors)
