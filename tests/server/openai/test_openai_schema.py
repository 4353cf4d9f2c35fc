"""The OpenAI port's /openapi.json is accurate: schemathesis generates requests from it for
every route and holds each answer to it (no 5xx; every status, content type and body as
documented). Bounded to a few examples per route, against the shared real server (tiny
model, real engine, API keys on)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)


EXAMPLES_PER_ROUTE = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def openai_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("openai_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_every_route_answers_as_its_schema_says(case, server):
    case.call_and_validate(headers=server.headers, checks=CHECKS, timeout=60)


def test_the_schema_documents_every_route_and_its_bodies(server):
    document = httpx.get(server.url + "/openapi.json").json()
    assert set(document["paths"]) == {"/health", "/ready", "/metrics", "/v1/models",
                                      "/v1/models/{model_id}", "/v1/completions",
                                      "/v1/chat/completions", "/tokenize", "/detokenize",
                                      "/v1/responses", "/v1/responses/{response_id}",
                                      "/v1/responses/{response_id}/input_items",
                                      "/v1/embeddings", "/v1/rerank"}
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert set(completions["responses"]) == {"200", "400", "401", "404", "413", "415", "429",
                                             "503", "504"}
    assert set(completions["responses"]["200"]["content"]) == {"application/json",
                                                               "text/event-stream"}
    assert "prompt" in document["components"]["schemas"]["CompletionRequest"]["required"]
    docs = httpx.get(server.url + "/docs")  # open, as /openapi.json is
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
