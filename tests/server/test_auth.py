"""API keys: the shared checker, the OpenAI app's 401s, and both gRPC interceptors."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from support.fake_engine import FakeEngine
from support.tiny_models import tiny
from tokenserve.errors import UnauthenticatedError
from tokenserve.server.auth import (ENV_VAR, APIKeyInterceptor, APIKeys, AsyncAPIKeyInterceptor,
                                    check_http_authorization)
from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app
from tokenserve.server.status import grpc_code, http_status

KEY = "sk-one"


def test_keys_accept_only_known_bearer_tokens():
    keys = APIKeys([KEY, " sk-two ", ""])
    assert keys.enabled
    for header in (f"Bearer {KEY}", f"bearer {KEY}", "Bearer sk-two", f"  Bearer   {KEY} "):
        assert keys.accepts(header), header
    for header in (None, "", KEY, f"Basic {KEY}", "Bearer sk-on", "Bearer ", f"Bearer {KEY}x"):
        assert not keys.accepts(header), header


def test_no_keys_means_open_and_errors_map_to_401_and_unauthenticated():
    assert APIKeys().accepts(None) and not APIKeys().enabled
    with pytest.raises(UnauthenticatedError, match="Missing API key") as caught:
        check_http_authorization(APIKeys([KEY]), {})
    assert http_status(caught.value) == 401
    assert grpc_code(caught.value) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(UnauthenticatedError, match="Incorrect API key"):
        APIKeys([KEY]).check_grpc_metadata([("authorization", b"Bearer nope")])


def test_environment_keys_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "sk-env-a, sk-env-b,")
    keys = APIKeys.from_sources(["sk-flag"])
    assert all(keys.accepts(f"Bearer {k}") for k in ("sk-flag", "sk-env-a", "sk-env-b"))
    monkeypatch.delenv(ENV_VAR)
    assert not APIKeys.from_sources().enabled
    assert APIKeys.from_sources(environ={ENV_VAR: "sk-x"}).accepts("Bearer sk-x")


@pytest.fixture(scope="module")
def http(tokenizer):
    _, config = tiny("tiny-gpt2", tokenizer)
    app = build_openai_app(StaticModels({"tiny": FakeEngine(tokenizer, config)}),
                           OpenAIServerConfig(api_keys=APIKeys([KEY])))
    with TestClient(app) as client:
        yield client


GUARDED = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
           ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 1}),
           ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]})]


@pytest.mark.parametrize("method,path,body", GUARDED, ids=[g[1] for g in GUARDED])
def test_every_api_endpoint_needs_the_key(http, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    ok = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_stay_open(http, path):
    assert http.get(path).status_code == 200


def _echo_handlers():
    return grpc.method_handlers_generic_handler("test.Echo", {
        "Ping": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Stream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request])),
    })


def test_sync_interceptor_guards_services_but_not_health():
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=[APIKeyInterceptor(APIKeys([KEY]))])
    server.add_generic_rpc_handlers((_echo_handlers(),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            ping = channel.unary_unary("/test.Echo/Ping")
            stream = channel.unary_stream("/test.Echo/Stream")
            good = (("authorization", f"Bearer {KEY}"),)
            assert ping(b"hi", metadata=good) == b"hi"
            assert list(stream(b"hi", metadata=good)) == [b"hi"]
            for call in (lambda: ping(b"hi"), lambda: list(stream(b"hi", metadata=(
                    ("authorization", "Bearer bad"),)))):
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


def test_async_interceptor_guards_services_but_not_health():
    async def scenario():
        from grpc_health.v1._async import HealthServicer

        async def ping(request, context):
            return request

        server = grpc.aio.server(interceptors=[AsyncAPIKeyInterceptor(APIKeys([KEY]))])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
            "Ping": grpc.unary_unary_rpc_method_handler(ping)}),))
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/test.Echo/Ping")
                assert await call(b"hi", metadata=(("authorization", f"Bearer {KEY}"),)) == b"hi"
                with pytest.raises(grpc.RpcError) as caught:
                    await call(b"hi")
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                check = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest())
                assert check.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(scenario())
