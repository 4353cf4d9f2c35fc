"""The OpenAI app against hostile input, in process (fake engine, real tokenizer): a
megabytes-long prompt neither blocks the event loop nor gets tokenized only to be refused,
and /metrics follows the API keys unless made public. The matrix of precise answers is in
test_openai_bad_input.py (real server)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from support.fake_engine import FakeEngine
from support.tiny_models import tiny
from tokenserve.server.auth import APIKeys
from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app
from tokenserve.server.openai.params import max_chars_per_token

BIG = ("def add(a, b):\n    return a + b\n" * 70_000)[:2_000_000]  # 2 MB of Python


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, tiny("tiny-gpt2", tokenizer)[1])


async def worst_health_latency(app, slow_request) -> tuple[float, float, httpx.Response]:
    """(slowest /health answer while `slow_request` runs, its duration, its response)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 timeout=120) as client:
        started = time.perf_counter()
        task = asyncio.create_task(slow_request(client))
        worst = 0.0
        while not task.done():
            before = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - before)
            await asyncio.sleep(0.01)
        return worst, time.perf_counter() - started, task.result()


def test_tokenizing_a_huge_text_does_not_block_the_event_loop(engine):
    """/tokenize counts any text, so it tokenizes 2 MB (seconds); /health and every stream
    on the port must keep being served meanwhile (it took 6-13 s before)."""
    app = build_openai_app(StaticModels({"m": engine}))
    worst, took, response = asyncio.run(worst_health_latency(
        app, lambda client: client.post("/tokenize", json={"prompt": BIG})))
    assert response.status_code == 200 and response.json()["count"] > 100_000
    assert took > 0.5, "too fast to show anything: make the text longer"
    assert worst < took / 4, (worst, took)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(engine):
    app = build_openai_app(StaticModels({"m": engine}))
    per_token = max_chars_per_token(engine.tokenizer)
    assert per_token is not None and per_token < 100
    with TestClient(app) as client:
        started = time.perf_counter()
        response = client.post("/v1/completions", json={"prompt": BIG, "max_tokens": 1})
        took = time.perf_counter() - started
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": BIG}], "max_tokens": 1})
    assert response.status_code == 400 and chat.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert f"your prompt has {len(BIG)} characters" in response.json()["error"]["message"]
    assert took < 1.0  # tokenizing it takes seconds
    assert not any(len(r[0]) > 1000 for r in engine.requests)


def test_a_prompt_just_within_the_character_bound_still_reaches_the_tokenizer(engine):
    """The bound is an upper one: text it lets through is tokenized and checked exactly."""
    limit = max_chars_per_token(engine.tokenizer) * engine.max_model_len
    app = build_openai_app(StaticModels({"m": engine}))
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={"prompt": "x" * limit})
    assert response.status_code == 400
    assert "However, you requested" in response.json()["error"]["message"]  # token count


@pytest.mark.parametrize("public", [False, True])
def test_metrics_follow_the_api_keys_unless_public(engine, public):
    registry = CollectorRegistry()
    app = build_openai_app(StaticModels({"m": engine}), OpenAIServerConfig(
        api_keys=APIKeys(["sk-1"]), metrics_registry=registry, metrics_public=public))
    with TestClient(app) as client:
        without_key = client.get("/metrics")
        with_key = client.get("/metrics", headers={"Authorization": "Bearer sk-1"})
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        assert client.get("/openapi.json").status_code == 200
    assert with_key.status_code == 200
    assert without_key.status_code == (200 if public else 401)
