"""Structured output through the servers: `response_format`, vLLM's `guided_*`, the official
client's `parse()` helper and the gRPC generation service, against a real server process
(tiny exported Llama with random weights: only the constraints make its output valid)."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from support.openai_harness import API_KEY, MODEL
from tokenserve.server.proto.tokenserve import generation_pb2 as pb
from tokenserve.server.proto.tokenserve import generation_pb2_grpc as pb_grpc

MESSAGES = [{"role": "user", "content": "A city?"}]
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
                         "tags": {"type": "array", "items": {"enum": ["big", "old", "wet"]},
                                  "maxItems": 3}},
          "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=server.headers,
                      timeout=60)


def test_json_schema_response_format_validates(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_json_object_mode_gives_an_object(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # a random model may not close in time
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].message.content.startswith("{")


def test_response_format_on_completions(client):
    out = client.completions.create(
        model=MODEL, prompt="A city:", max_tokens=80, temperature=1.0, seed=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": SCHEMA}}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    out = client.completions.create(model=MODEL, prompt="A city:", max_tokens=8,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text.startswith("{")
    out = client.completions.create(model=MODEL, prompt="A city:", max_tokens=3, seed=0,
                                    extra_body={"response_format": {"type": "text"}})
    assert out.choices[0].finish_reason == "length"  # unconstrained


class Weather(BaseModel):
    city: str = Field(max_length=8)
    celsius: int = Field(ge=-50, le=60)
    sky: str = Field(json_schema_extra={"enum": ["clear", "cloudy", "rain"]})


def test_openai_parse_helper_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                response_format=Weather, max_tokens=80)
    weather = out.choices[0].message.parsed
    assert isinstance(weather, Weather)
    assert -50 <= weather.celsius <= 60 and weather.sky in ("clear", "cloudy", "rain")


def test_guided_regex_and_choice_on_completions_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="phone:", max_tokens=20, n=3,
                                    temperature=1.0, seed=1,
                                    extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert len(choice.text) == 8 and choice.text[3] == "-"
        assert (choice.text[:3] + choice.text[4:]).isdigit()
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=4,
                                         temperature=1.0, seed=2,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert {c.message.content for c in out.choices} <= {"yes", "no", "maybe"}


def test_guided_json_and_grammar_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="x =", max_tokens=80,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    grammar = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'  # GBNF
    out = client.completions.create(model=MODEL, prompt="x =", max_tokens=20,
                                    extra_body={"guided_grammar": grammar})
    text = out.choices[0].text
    assert text.startswith("(") and text.endswith(")"), text


def test_streamed_structured_output_equals_the_whole(client):
    body = {"guided_json": SCHEMA}
    whole = client.completions.create(model=MODEL, prompt="x =", max_tokens=80,
                                      extra_body=body)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x =", max_tokens=80, stream=True, extra_body=body) if c.choices)
    assert streamed == whole.choices[0].text


BAD = [
    ({"guided_json": {"type": "strin"}}, "guided_json", "Invalid type"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json",
     "Unsatisfiable"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "does not exist"),
    ({"guided_json": {"type": "object", "required": "a"}}, "guided_json", "required"),
    ({"guided_regex": "(["}, "guided_regex", "unclosed"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "At most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "json_schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "yaml"}}, None, "response_format"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] or "type" for b in BAD])
def test_bad_constraints_get_400_naming_the_problem(server, extra, param, words):
    before = server.num_unfinished()
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5,
                                                     **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" or response.status_code == 400
    assert words.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    assert server.num_unfinished() == before


def test_bad_constraint_on_completions_gets_400(server):
    response = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(["})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc_target)
    yield pb_grpc.GenerationServiceStub(channel)
    channel.close()


def grpc_text(stub, **sampling) -> str:
    request = pb.GenerateRequest(model=MODEL, text="x =",
                                 sampling=pb.SamplingOptions(max_tokens=80, **sampling))
    responses = stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),),
                              timeout=60)
    return "".join(d.text for r in responses for d in r.outputs)


def test_grpc_guided_fields(stub):
    jsonschema.validate(json.loads(grpc_text(stub, guided_json=json.dumps(SCHEMA))), SCHEMA)
    assert grpc_text(stub, guided_choice=pb.GuidedChoice(choices=["up", "down"])) in (
        "up", "down")
    text = grpc_text(stub, guided_regex="[a-c]{2,5}!")
    assert text.endswith("!") and set(text[:-1]) <= set("abc")
    with pytest.raises(grpc.RpcError) as raised:
        grpc_text(stub, guided_json='{"type": "strin"}')
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Invalid type" in raised.value.details()
