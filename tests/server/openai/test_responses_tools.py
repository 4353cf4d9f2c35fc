"""Function tools and structured output on the Responses API, with the official `openai`
client against real servers (the built-in model, whose 512-token context holds the tools'
listing, and the shared tiny Llama for refusals; both the default chat template): forced
calls that validate against the tool's schema even from a random model, their streamed
events, function_call_output turns (stored or sent whole, the same prompt either way),
text.format through `responses.parse`, logprobs as chat completions give them, and precise
400s for what is not served."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from support.openai_harness import API_KEY, MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}},
           "strict": True}
TIME = {"type": "function", "name": "get_time", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
ASK = "Weather in Oslo?"


@pytest.fixture(scope="module")
def client(builtin_server):
    return openai.OpenAI(base_url=builtin_server.url + "/v1", api_key=API_KEY, max_retries=0)


def forced_call(client, **options):
    options = {"tools": [WEATHER, TIME], "tool_choice": "required",
               "parallel_tool_calls": False, "max_output_tokens": 160, "temperature": 1.0,
               **options}
    return client.responses.create(model=MODEL, input=ASK, **options)


def check_call(item, names=("get_weather", "get_time")):
    assert item.type == "function_call" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert item.name in names
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_required_gives_one_valid_function_call_item(client):
    response = forced_call(client)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["function_call"]
    check_call(response.output[0])
    assert response.tool_choice == "required" and response.parallel_tool_calls is False
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    assert response.output_text == ""


def test_a_named_function_is_the_one_called(client):
    response = forced_call(client, tool_choice={"type": "function", "name": "get_time"})
    assert len(response.output) == 1
    check_call(response.output[0], names=("get_time",))
    assert response.tool_choice.type == "function" and response.tool_choice.name == "get_time"


def test_streamed_call_events_add_up_to_the_final_item(client):
    events = list(forced_call(client, tools=[WEATHER], stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert len(kinds) - 6 > 1  # the arguments stream, they do not arrive at the end
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added, done, final = events[2].item, events[-2].item, events[-1].response.output[0]
    assert added.status == "in_progress" and added.arguments == ""
    assert added.id == done.id == final.id and added.call_id == done.call_id == final.call_id
    streamed = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert streamed == events[-3].arguments == done.arguments == final.arguments
    assert {e.item_id for e in events if e.type.endswith("arguments.delta")} == {final.id}
    check_call(final, names=("get_weather",))


def test_a_function_call_output_continues_a_stored_response_as_a_whole_input_would(client):
    """Turn two by previous_response_id renders the same prompt as the whole conversation
    sent at once (the user's message, the call, its output): same input tokens, same greedy
    answer."""
    first = forced_call(client, tools=[WEATHER])
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temperature": "RESULT-21C"}'}
    options = dict(model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0.0,
                   max_output_tokens=6)
    stored = client.responses.create(input=[result], previous_response_id=first.id, **options)
    whole = client.responses.create(
        input=[{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}, result], store=False, **options)
    assert stored.usage.input_tokens == whole.usage.input_tokens
    assert stored.usage.input_tokens > first.usage.input_tokens
    assert stored.output_text == whole.output_text
    assert [item.type for item in stored.output] == ["message"]
    items = client.responses.input_items.list(stored.id).data
    assert [(item.type, item.call_id) for item in items] == [("function_call_output",
                                                              call.call_id)]


def test_the_call_and_its_output_reach_the_prompt(builtin_server):
    """The rendered prompt holds the call and its result: each makes the prompt longer,
    the result by at least its twenty words (input tokens of one-token responses)."""
    server = builtin_server

    def input_tokens(items):
        response = httpx.post(server.url + "/v1/responses", headers=server.headers,
                              json={"model": MODEL, "input": items, "max_output_tokens": 1,
                                    "store": False})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens"]

    ask = {"role": "user", "content": ASK}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "RESULT " * 20}
    alone, with_call, with_output = (input_tokens([ask]), input_tokens([ask, call]),
                                     input_tokens([ask, call, output]))
    assert alone < with_call < with_output
    assert with_output - with_call >= 20  # the twenty words of the result are in it


class Package(BaseModel):
    name: str = Field(max_length=16)
    version: int = Field(ge=1, le=99)


def test_text_format_json_schema_parses_into_the_model(client):
    response = client.responses.parse(model=MODEL, input="Describe a Python package.",
                                      text_format=Package, max_output_tokens=60,
                                      temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Package)  # the client validated it
    assert response.text.format.type == "json_schema"
    assert response.text.format.name == "Package"


def test_text_format_json_object_gives_an_object(client):
    response = client.responses.create(model=MODEL, input="Some JSON:", temperature=0,
                                       max_output_tokens=60,
                                       text={"format": {"type": "json_object"}})
    if response.status == "completed":  # a cut-off object is not JSON yet
        assert isinstance(json.loads(response.output_text), dict)
    else:
        assert response.output_text.startswith("{")


def test_logprobs_are_chat_completions_logprobs_for_the_same_conversation(client):
    """The same user message, greedy: the Responses API's logprobs are the tokens, logprobs
    and alternatives chat completions give, streamed or not."""
    text = "def add(a, b):"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
        max_tokens=8, logprobs=True, top_logprobs=2).choices[0].logprobs.content

    def rows(entries):  # tokens exactly, logprobs to float32 noise (steps batch otherwise)
        return [(e.token, pytest.approx(e.logprob, abs=1e-3),
                 [(t.token, pytest.approx(t.logprob, abs=1e-3)) for t in e.top_logprobs])
                for e in entries]

    options = dict(model=MODEL, input=text, temperature=0, max_output_tokens=8,
                   include=["message.output_text.logprobs"], top_logprobs=2)
    plain = client.responses.create(**options).output[0].content[0].logprobs
    assert rows(plain) == rows(chat) and all(len(e.top_logprobs) == 2 for e in plain)
    assert len(plain) == 8
    events = list(client.responses.create(stream=True, **options))
    streamed = [e for event in events if event.type == "response.output_text.delta"
                for e in event.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert rows(final) == rows(chat)
    assert rows(streamed) == rows(final)[:len(streamed)] and streamed
    without = client.responses.create(model=MODEL, input=text, temperature=0,
                                      max_output_tokens=8)
    assert without.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(client):
    """A conversation past the built-in model's 512 tokens: refused by default (as OpenAI's
    "disabled"), answered with "auto" from the newest turns that fit, the same greedy answer
    chat completions gives for those turns alone; a last message that cannot fit by itself
    is refused either way."""
    long = "def f(x):\n    return x + 1\n" * 30  # about 300 tokens
    conversation = [{"role": "user", "content": long}, {"role": "assistant", "content": long},
                    {"role": "user", "content": "def add(a, b):"}]
    options = dict(model=MODEL, input=conversation, temperature=0, max_output_tokens=8)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**options)
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(truncation="disabled", **options)

    answered = client.responses.create(truncation="auto", **options)
    assert answered.truncation == "auto" and answered.status in ("completed", "incomplete")
    # both long messages go (dropping the first user turn takes its answer along)
    chat = client.chat.completions.create(model=MODEL, messages=conversation[2:],
                                          temperature=0, max_tokens=8)
    assert answered.output_text == chat.choices[0].message.content
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    streamed = list(client.responses.create(truncation="auto", stream=True, **options))
    assert streamed[-1].response.output_text == answered.output_text

    too_long = [{"role": "user", "content": "hi"}, {"role": "user", "content": long * 2}]
    with pytest.raises(openai.BadRequestError) as still:
        client.responses.create(model=MODEL, input=too_long, max_output_tokens=8,
                                truncation="auto")
    assert still.value.code == "context_length_exceeded"
    assert client.responses.create(model=MODEL, input="hi",
                                   max_output_tokens=2).truncation == "disabled"


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
     "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]},
     "input.0.arguments"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": ["hello"]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}],
      "tool_choice": "required"}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["file_search_call.results", "no.such.output"]}, "include.1"),
    ({"tools": [WEATHER], "include": ["message.output_text.logprobs"]}, "include"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"truncation": "sometimes"}, "truncation"),
])
def test_bad_tool_requests_get_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/responses", headers=server.headers,
                          json={"model": MODEL, "input": ASK, "max_output_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert httpx.post(server.url + "/v1/responses", headers=server.headers, json={
        "model": MODEL, "input": ASK, "max_output_tokens": 2}).status_code == 200
