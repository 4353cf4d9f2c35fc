"""The OpenAI app's own logic on the fake engine: deadlines, readiness, batched prompts,
echo, parameter mapping, chat templates, errors after a stream started, metrics."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from support.fake_engine import FakeEngine
from support.tiny_models import tiny
from tokenserve.errors import ServableUnavailableError
from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app
from tokenserve.server.openai.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from tokenserve.stats import StatsSink

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
STRICT = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
          "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


class Rejections(StatsSink):
    def __init__(self):
        self.reasons = []

    def on_rejection(self, stats):
        self.reasons.append((stats.model, stats.reason))


@pytest.fixture(scope="module")
def setup(tokenizer):
    _, config = tiny("tiny-gpt2", tokenizer)
    engines = {"tiny": FakeEngine(tokenizer, config, step_s=0.001),
               "slow": FakeEngine(tokenizer, config, step_s=0.02),
               "chatml": FakeEngine(tokenizer, dataclasses.replace(config, chat_template=CHATML)),
               "strict": FakeEngine(tokenizer, dataclasses.replace(config, chat_template=STRICT))}
    registry = CollectorRegistry()
    Counter("probe_total", "a probe", registry=registry).inc()
    stats = Rejections()
    app = build_openai_app(StaticModels(engines), OpenAIServerConfig(
        max_prompts=3, metrics_registry=registry), stats)
    with TestClient(app) as client:
        yield client, engines, stats


def events(response) -> list:
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_deadline_is_504_when_not_streamed_and_abort_when_streamed(setup):
    client, engines, _ = setup
    body = {"model": "slow", "prompt": "x", "max_tokens": 100, "timeout_s": 0.1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert engines["slow"].requests[-1][3] == pytest.approx(0.1)  # the engine got the deadline
    chunks = events(client.post("/v1/completions", json={**body, "stream": True}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) < 100


def test_server_timeout_caps_the_request_timeout(tokenizer):
    engine = FakeEngine(tokenizer, tiny("tiny-gpt2", tokenizer)[1])
    app = build_openai_app(StaticModels({"m": engine}), OpenAIServerConfig(request_timeout_s=5))
    with TestClient(app) as client:
        for asked, expected in [(None, 5), (2.0, 2.0), (50.0, 5)]:
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                 "timeout_s": asked})
            assert engines_timeout(engine) == expected


def engines_timeout(engine):
    return engine.requests[-1][3]


def test_readiness_follows_the_default_engine(setup):
    client, engines, _ = setup
    engines["tiny"].ready = False
    try:
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200
    finally:
        engines["tiny"].ready = True
    assert client.get("/ready").json() == {"status": "ready", "model": "tiny"}


def test_a_model_without_an_available_version_is_503(tokenizer):
    class NoneAvailable(StaticModels):
        def resolve(self, model_id):
            raise ServableUnavailableError(f"{model_id} has no AVAILABLE version yet")

    engine = FakeEngine(tokenizer, tiny("tiny-gpt2", tokenizer)[1])
    with TestClient(build_openai_app(NoneAvailable({"m": engine}))) as client:
        assert client.get("/ready").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert "no AVAILABLE version" in response.json()["error"]["message"]


def test_batched_prompts_get_one_choice_per_prompt_and_sequence(setup):
    client, _, _ = setup
    body = {"prompt": ["def a", "class B", "import c"], "n": 2, "max_tokens": 3,
            "temperature": 1.0, "seed": 1}
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    assert whole["usage"]["completion_tokens"] == 18
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    texts = {}
    for chunk in streamed:
        choice = chunk["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    too_many = client.post("/v1/completions", json={**body, "prompt": ["a"] * 4})
    assert too_many.status_code == 400 and "At most 3 prompts" in too_many.text


def test_echo_prepends_the_prompt(setup):
    client, _, _ = setup
    body = {"prompt": "def add(a, b):", "max_tokens": 3, "echo": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    plain = client.post("/v1/completions", json={**body, "echo": False}).json()
    assert whole == "def add(a, b):" + plain["choices"][0]["text"]
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed) == whole


def test_every_sampling_parameter_reaches_the_engine(setup):
    client, engines, _ = setup
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
            "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "seed": 11, "stop": "END", "stop_token_ids": [7],
            "ignore_eos": True, "n": 2, "logprobs": 3}
    assert client.post("/v1/completions", json=body).status_code == 200
    params = engines["tiny"].requests[-1][1]
    for name, value in body.items():
        if name not in ("prompt", "stop", "stop_token_ids"):
            assert getattr(params, name) == value, name
    assert params.stop == ("END",) and params.stop_token_ids == (7,)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "stop": ["a", "b"]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    params = engines["tiny"].requests[-1][1]
    assert (params.max_tokens, params.logprobs, params.stop) == (4, 2, ("a", "b"))


def test_default_max_tokens_is_16_for_completions_and_the_context_for_chat(setup):
    client, engines, _ = setup
    client.post("/v1/completions", json={"prompt": "x"})
    assert engines["tiny"].requests[-1][1].max_tokens == 16
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    prompt_ids, params = engines["tiny"].requests[-1][:2]
    assert params.max_tokens == engines["tiny"].max_model_len - len(prompt_ids)


def test_chat_uses_the_model_template_or_the_default(setup, tokenizer):
    client, _, _ = setup
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for model, template in [("chatml", CHATML), ("tiny", DEFAULT_CHAT_TEMPLATE)]:
        ids = client.post("/tokenize", json={"model": model, "messages": messages}).json()
        expected = render_chat(template, messages, eos_token=tokenizer.decode(
            [tokenizer.eos_token_id], skip_special_tokens=False))
        assert ids["tokens"] == tokenizer.encode(expected)
    assert render_chat(None, messages) == "# system: be brief\n# user: hi\n# assistant:"
    refused = client.post("/v1/chat/completions", json={"model": "strict", "messages": [
        {"role": "assistant", "content": "x"}]})
    assert refused.status_code == 400 and "first must be user" in refused.text


def test_an_engine_failure_after_the_stream_started_is_an_error_event(setup):
    client, engines, _ = setup
    engines["tiny"].fail_after = 2
    try:
        chunks = events(client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 10, "stream": True}))
    finally:
        engines["tiny"].fail_after = None
    assert chunks[-1]["error"]["code"] == "model_unavailable"
    assert "stopped" in chunks[-1]["error"]["message"]


def test_rejections_are_reported_to_the_stats_sink(setup):
    client, _, stats = setup
    stats.reasons.clear()
    client.post("/v1/completions", json={"model": "tiny", "prompt": ""})
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 999})
    client.post("/v1/completions", json={"model": "gone", "prompt": "x"})
    client.post("/v1/completions", json={"model": "tiny:9", "prompt": "x"})
    assert stats.reasons == [("tiny", "invalid"), ("tiny", "too_long"),
                             ("(unknown)", "not_found"), ("tiny", "not_found")]


def test_unknown_model_names_never_become_metric_labels(tokenizer):
    """Names a client makes up (NUL bytes, 8,000 characters) are counted under one label,
    so /metrics does not grow with them (it grew from 94 KB to 6.6 MB in 400 requests)."""
    from tokenserve.observability.llm_metrics import LLMMetrics

    registry = CollectorRegistry()
    app = build_openai_app(StaticModels({"m": FakeEngine(tokenizer, tiny("tiny-gpt2",
                                                                         tokenizer)[1])}),
                           OpenAIServerConfig(metrics_registry=registry),
                           stats=LLMMetrics(registry))
    with TestClient(app) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": ""})
        before = len(client.get("/metrics").text)
        for i in range(50):
            name = f"evil-{i}-\x00-" + "x" * 8000
            assert client.post("/v1/completions", json={"model": name, "prompt": "x"}
                               ).status_code == 404
        text = client.get("/metrics").text
    assert "evil" not in text and "xxxx" not in text
    assert 'tokenserve:rejected_requests_total{model_name="(unknown)",model_version="",' \
           'reason="not_found"} 50.0' in text
    assert len(text) < before + 2000


def test_metrics_serve_the_configured_registry_and_responses_carry_request_ids(setup):
    client, _, _ = setup
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "probe_total 1.0" in metrics.text
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert response.headers["x-request-id"] == response.json()["id"]
    assert client.get("/v1/models/tiny:1").json()["root"] == "tiny"


def test_w3c_trace_headers_reach_the_engine_and_text_parts_are_joined(setup):
    client, engines, _ = setup
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response = client.post("/v1/chat/completions", headers={"traceparent": parent}, json={
        "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "add "}, {"type": "text", "text": "two"}]}]})
    assert response.status_code == 200
    assert engines["tiny"].trace_contexts[-1] == {"traceparent": parent}
    prompt = engines["tiny"].requests[-1][0]
    assert engines["tiny"].tokenizer.decode(prompt).startswith("# user: add two\n")
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert engines["tiny"].trace_contexts[-1] is None


def test_a_batched_prompt_refused_by_the_engine_aborts_its_siblings(tokenizer):
    engine = FakeEngine(tokenizer, tiny("tiny-gpt2", tokenizer)[1], step_s=0.01,
                        max_requests=2)
    with TestClient(build_openai_app(StaticModels({"m": engine}))) as client:
        response = client.post("/v1/completions", json={"prompt": ["a", "b", "c"],
                                                        "max_tokens": 50})
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
    assert not engine.running and len(engine.aborted) == 2
