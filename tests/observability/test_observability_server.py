"""Observability wired to the real engine and OpenAI app: scrape /metrics after real requests
and check counts and token counters against the usage the API reported; check that a
request's spans join the caller's trace."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from support.openai_harness import export_tiny_model
from tokenserve.observability.llm_metrics import LLMMetrics
from tokenserve.observability.sinks import FanOutSink
from tokenserve.observability.tracing import RequestTracer, TracingConfig, make_tracer_provider

MODEL = "tiny"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


class Server:
    """Engine + OpenAI app under uvicorn in a thread with its own event loop."""

    def __init__(self, model_dir):
        self.registry = CollectorRegistry()
        self.metrics = LLMMetrics(self.registry)
        self.spans = InMemorySpanExporter()
        self.tracer = RequestTracer(make_tracer_provider(TracingConfig(), exporter=self.spans))
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._started = threading.Event()
        self._http = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(model_dir),),
                                        daemon=True)
        self._thread.start()
        assert self._started.wait(120), "server did not start"

    async def _serve(self, model_dir) -> None:
        import uvicorn

        from tokenserve.engine.async_engine import AsyncEngine
        from tokenserve.engine.config import EngineConfig
        from tokenserve.server.openai import OpenAIServerConfig, StaticModels, build_openai_app

        engine = AsyncEngine.from_model_dir(
            model_dir, EngineConfig(max_num_seqs=4, block_size=4, precision="float32",
                                    max_num_batched_tokens=64),
            stats=FanOutSink(self.metrics, self.tracer), model_name=MODEL, version="1")
        app = build_openai_app(StaticModels({MODEL: engine}),
                               OpenAIServerConfig(metrics_registry=self.registry),
                               stats=self.metrics)
        self._http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        task = asyncio.create_task(self._http.serve(sockets=[self._sock]))
        while not self._http.started:
            await asyncio.sleep(0.01)
        self._started.set()
        await task
        engine.shutdown()

    def scrape(self) -> dict[tuple, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def close(self) -> None:
        self._http.should_exit = True
        self._thread.join(timeout=30)
        self.tracer.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(export_tiny_model(tmp_path_factory.mktemp("observability-tiny")))
    yield served
    served.close()


def total(samples: dict, name: str, **labels) -> float:
    """Sum of a series over the labels not given."""
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and labels.items() <= dict(sample_labels).items())


def stream_usage(client: httpx.Client, prompt: str, max_tokens: int, headers=None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with client.stream("POST", "/v1/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = httpx.Response(200, content=line[len("data: "):]).json()["usage"]
    return usage


def test_metrics_after_real_requests_match_the_reported_usage(server):
    before = server.scrape()
    usages = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for index, prompt in enumerate(["def add(a, b):", "class Point:", "import os"]):
            response = client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 3 + index, "temperature": 0.0})
            assert response.status_code == 200
            usages.append(response.json()["usage"])
        usages.append(stream_usage(client, "for item in items:", 6))
        assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}
                           ).status_code == 404
    after = server.scrape()

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:request_success_total", model_name=MODEL) == len(usages)
    assert delta("vllm:prompt_tokens_total", model_name=MODEL) == \
        sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total", model_name=MODEL) == \
        sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:time_to_first_token_seconds_count", model_name=MODEL) == len(usages)
    assert delta("vllm:e2e_request_latency_seconds_count", model_name=MODEL) == len(usages)
    assert delta("vllm:inter_token_latency_seconds_count", model_name=MODEL) == \
        sum(u["completion_tokens"] - 1 for u in usages)
    assert delta("tokenserve:batch_size_count", model_name=MODEL) >= 1
    assert delta("tokenserve:rejected_requests_total", reason="not_found") == 1
    assert ("vllm:num_requests_running", (("model_name", MODEL), ("model_version", "1"))) in after


def test_spans_join_the_callers_trace(server):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        usage = stream_usage(client, "def add(a, b):", 4, headers=headers)
    assert usage["completion_tokens"] == 4
    server.tracer.provider.force_flush()
    spans = [span for span in server.spans.get_finished_spans()
             if span.context.trace_id == int(TRACE_ID, 16)]
    names = {span.name: span for span in spans}
    assert set(names) == {"llm_request", "queue", "prefill", "decode"}
    request = names["llm_request"]
    assert request.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert request.attributes["gen_ai.usage.completion_tokens"] == 4
    for phase in ("queue", "prefill", "decode"):
        assert names[phase].parent.span_id == request.context.span_id
    assert names["queue"].end_time <= names["prefill"].start_time + 1  # ns rounding
    assert names["prefill"].end_time <= names["decode"].start_time + 1
