"""gRPC: tensorflow.serving.PredictionService and ModelService with the official stubs'
servicer bases, plus grpc.health.v1, on TCP and an optional Unix socket.

The server is grpc.aio, so other aio services (the streaming generation service) can share
port 8500; blocking inference runs on a thread pool, never on the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
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


async def _call(executor, metrics, api: str, model_name: str, context,
                work: Callable[[], object]):
    """Runs one RPC's blocking work on the executor; maps errors through server/status.py
    and records TF Serving metrics."""
    started = time.monotonic()
    try:
        response = await asyncio.get_running_loop().run_in_executor(executor, work)
    except Exception as error:  # noqa: BLE001 - every error becomes a status
        code = grpc_code(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", api, exc_info=error)
        if metrics:
            metrics.request(model_name, api, ENTRYPOINT, code.name, time.monotonic() - started)
        await context.abort(code, str(error))
    if metrics:
        metrics.request(model_name, api, ENTRYPOINT, "OK", time.monotonic() - started)
    return response


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    """tensorflow.serving.PredictionService (grpc.aio; inference runs on `executor`)."""

    def __init__(self, manager: ModelManager, executor, metrics=None):
        self._manager = manager
        self._executor = executor
        self._metrics = metrics

    async def _run(self, api, name, context, work):
        return await _call(self._executor, self._metrics, api, name, context, work)

    async def Predict(self, request, context):
        return await self._run("Predict", request.model_spec.name, context,
                               lambda: inference.predict(self._manager, request))

    async def Classify(self, request, context):
        return await self._run("Classify", request.model_spec.name, context,
                               lambda: inference.classify(self._manager, request))

    async def Regress(self, request, context):
        return await self._run("Regress", request.model_spec.name, context,
                               lambda: inference.regress(self._manager, request))

    async def MultiInference(self, request, context):
        name = request.tasks[0].model_spec.name if request.tasks else ""
        return await self._run("MultiInference", name, context,
                               lambda: inference.multi_inference(self._manager, request))

    async def GetModelMetadata(self, request, context):
        return await self._run("GetModelMetadata", request.model_spec.name, context,
                               lambda: model_info.model_metadata(self._manager, request))


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """tensorflow.serving.ModelService: status and full-replacement config reload."""

    def __init__(self, manager: ModelManager, executor):
        self._manager = manager
        self._executor = executor

    async def GetModelStatus(self, request, context):
        return await _call(self._executor, None, "GetModelStatus", request.model_spec.name,
                           context,
                           lambda: model_info.model_status(self._manager, request.model_spec))

    async def HandleReloadConfigRequest(self, request, context):
        def reload():
            self._manager.apply_config(from_proto(request.config), wait=True)
            return model_management_pb2.ReloadConfigResponse(
                status=status_pb2.StatusProto(error_code=0))
        return await _call(self._executor, None, "HandleReloadConfigRequest", "", context, reload)


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
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(manager, executor, metrics), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(
        ModelServicer(manager, executor), server)
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
