"""Every request field of the OpenAI routes, set to each value of a list of wrong types and
absurd values, against a real server process: no answer may be a 5xx, every answer must be
an OpenAI error body or a success, and the server must still stream a good request after.

The matrix in test_openai_bad_input.py checks chosen inputs and their exact messages; this
checks breadth, which is how a 500 on `response_format` in completions was found (the field
was read as an object where the request model did not declare it)."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from support.openai_harness import MODEL
from tokenserve.server.openai.responses_schemas import ResponseCreateRequest
from tokenserve.server.openai.schemas import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, TokenizeRequest)

VALUES = [None, True, -1, 0, 1.5, -1e308, 1e308, "x", "", [], {}, [1, "a"], [[1]], 2**63,
          ["\u0000"], {"type": "xml"}, "a\ud800", {"k\udfff": "v"}]
QUICK = [None, -1, "x", {}, "a\ud800"]
"""The default run's share of VALUES: one of each kind (null, number, string, object, a lone
surrogate); `pytest -m slow` runs them all."""
ROUTES = {  # path: (a good request, its request model)
    "/v1/completions": ({"model": MODEL, "prompt": "x", "max_tokens": 1}, CompletionRequest),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1}, ChatCompletionRequest),
    "/v1/responses": ({"model": MODEL, "input": "hi", "max_output_tokens": 1},
                      ResponseCreateRequest),
    "/tokenize": ({"model": MODEL, "prompt": "hi"}, TokenizeRequest),
    "/detokenize": ({"model": MODEL, "tokens": [5, 6]}, DetokenizeRequest),
}


GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def declared(request_model) -> set[str]:
    return {info.alias or name for name, info in request_model.model_fields.items()}


def fields(path: str) -> list[str]:
    """The fields to set on `path`: those it declares (by their JSON names), and on a
    generation route those of the other generation routes too (sent where they are not
    declared, they must be ignored or refused, never read: the 500 above was one), plus
    logit_bias, which is refused by name, and one unknown field."""
    names = declared(ROUTES[path][1]) | {"logit_bias", "my_field"}
    if path in GENERATION:
        names |= set().union(*(declared(ROUTES[p][1]) for p in GENERATION))
    return sorted(names)


@pytest.mark.parametrize("values", [QUICK, pytest.param(VALUES, marks=pytest.mark.slow)],
                         ids=["quick", "all"])
def test_no_field_value_gets_a_5xx(server, values):
    statuses: Counter = Counter()
    failures = []
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        for path, (good, _) in ROUTES.items():
            for field in fields(path):
                for value in values:
                    body = json.dumps({**good, field: value})
                    response = client.post(path, content=body,
                                           headers={"Content-Type": "application/json"})
                    response.read()  # a stream, too, to its end
                    statuses[response.status_code] += 1
                    if response.status_code >= 500:
                        failures.append((path, field, value, response.status_code,
                                         response.text[:200]))
                    elif response.status_code >= 400:
                        assert set(response.json()["error"]) == {"message", "type", "param",
                                                                 "code"}
        assert not failures, failures[:10]
        # not vacuous: most values are refused, and many requests still succeed
        assert statuses[400] > 40 * len(values) and statuses[200] > 15 * len(values), statuses
        with client.stream("POST", "/v1/completions",
                           json={**ROUTES["/v1/completions"][0], "stream": True,
                                 "max_tokens": 8, "ignore_eos": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 9
