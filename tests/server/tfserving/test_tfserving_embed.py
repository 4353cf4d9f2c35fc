"""`serve()` embedded in a process: extensions run per version before it is AVAILABLE and
close after the version drains at shutdown; extra gRPC services share the port."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import servables as S
from tokenserve.server.config import ServeConfig
from tokenserve.server.tfserving.server import serve


def test_serve_with_extension_and_stop_event(tmp_path):
    S.write_tf2_model(tmp_path / "m", 1)
    events = []

    class Engine:
        def __init__(self, version):
            events.append(("built", version.model_name, version.version, version.state.name))

        def close(self):
            events.append(("closed",))

    added = []

    async def add_service(server):
        added.append(server)

    config = ServeConfig(port=S.free_port(), rest_api_port=S.free_port(), openai_port=0,
                         model_name="m", model_base_path=str(tmp_path / "m"))
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(config,), daemon=True, kwargs={
        "extensions": {"engine": Engine}, "grpc_services": [add_service], "stop_event": stop})
    thread.start()
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{config.rest_api_port}/v1/models/m",
                             timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            thread.join(0.1)
        else:
            pytest.fail("server did not start")
        assert events == [("built", "m", 1, "LOADING")]
        assert len(added) == 1
        with grpc.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert events[-1] == ("closed",)
