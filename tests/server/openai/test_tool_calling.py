"""Tool calling on chat: parsing and streaming calls, forced calls that validate against the
tool's schema even from a random model, `role: "tool"` turns, with the default template
(tiny Llama) and Qwen2.5's template (tiny imported Qwen2-style model), over real servers."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from support.openai_harness import API_KEY, MODEL, RealServer
from tokenserve.server.openai.tools import ToolCallFormat, ToolCallStream, parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def feed_in_pieces(text: str, size: int, fmt=ToolCallFormat.HERMES):
    stream, content, calls = ToolCallStream(fmt), "", {}
    for i in range(0, len(text), size):
        piece, deltas = stream.feed(text[i:i + size])
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            call["name"] = delta.function.name or call["name"]
            call["arguments"] += delta.function.arguments or ""
    return content + stream.finish(), calls


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "O}s\\"lo", '
             '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": {"zone": "UTC"}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_calls_reassemble_whatever_the_chunking(size):
    content, calls = feed_in_pieces(TWO_CALLS, size)
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'O}s"lo', "unit": "celsius"}
    assert json.loads(calls[1]["arguments"]) == {"zone": "UTC"}


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_text_around_calls_and_plain_text(size):
    content, calls = feed_in_pieces("Let me check. " + TWO_CALLS, size)
    assert content == "Let me check. " and len(calls) == 2
    for text in ("plain answer", "a < b and <tool", "{not a call}", ""):
        assert feed_in_pieces(text, size) == (text, {})
    content, calls = feed_in_pieces('{"name": "get_time", "parameters": {"zone": "CET"}}', size,
                                    ToolCallFormat.LLAMA3_JSON)
    assert content == "" and json.loads(calls[0]["arguments"]) == {"zone": "CET"}


def test_parse_whole_text():
    content, calls = parse_tool_calls(TWO_CALLS, ToolCallFormat.HERMES)
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("hi", ToolCallFormat.HERMES) == ("hi", [])


def test_template_format_detection():
    from support.qwen2_tiny import QWEN2_CHAT_TEMPLATE

    assert ToolCallFormat.of_template(QWEN2_CHAT_TEMPLATE) is ToolCallFormat.HERMES
    assert ToolCallFormat.of_template(None) is ToolCallFormat.HERMES
    llama3 = "{{- '<|python_tag|>' }}{{ '{\"name\": ' }}{{ '\"parameters\": ' }}"
    assert ToolCallFormat.of_template(llama3) is ToolCallFormat.LLAMA3_JSON


# -- over real servers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_server(tmp_path_factory):
    pytest.importorskip("torch")
    from support.qwen2_tiny import qwen2_tiny_dir

    server = RealServer(qwen2_tiny_dir(tmp_path_factory))
    yield server
    server.close()


@pytest.fixture(params=["builtin", "qwen2"])
def client(request):
    target = request.getfixturevalue(f"{request.param}_server")
    return openai.OpenAI(base_url=target.url + "/v1", api_key=API_KEY, max_retries=0)


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_gives_valid_calls(client, seed):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=160,
                                         parallel_tool_calls=False, temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_parallel_calls_each_validate(builtin_server):
    """The model decides how many calls to make; every finished one is valid."""
    client = openai.OpenAI(base_url=builtin_server.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=150,
                                         temperature=1.0, seed=7)
    choice = out.choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "length":  # the last call may be cut off
        calls = calls[:-1]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_and_no_parallel_calls(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1
    check_calls(calls, names=("get_time",))


def test_streamed_tool_call_reassembles_into_valid_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=160,
        parallel_tool_calls=False, temperature=1.0, seed=3, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "arguments": ""})
            if delta.function.name:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and all(c["id"].startswith("call_") for c in calls.values())
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])
    # more than one chunk carried arguments: they stream, not arrive at the end
    assert sum(1 for c in chunks for d in c.choices[0].delta.tool_calls or []
               if d.function.arguments) > 1


def test_tool_results_continue_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", max_tokens=160,
                                           parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    follow = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=5)
    assert follow.choices[0].message.tool_calls is None
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_results_reach_the_prompt(server):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-21C"}]
    response = httpx.post(server.url + "/tokenize", headers=server.headers,
                          json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    detok = httpx.post(server.url + "/detokenize", headers=server.headers,
                       json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert "RESULT-21C" in detok and '"name": "get_weather"' in detok


@pytest.mark.parametrize("arguments", ["not json", "[" * 3000 + "]" * 3000,
                                       '{"n": ' + "9" * 5000 + "}"])
def test_arguments_json_cannot_read_reach_the_prompt_as_text(server, arguments):
    """The template gets parsed arguments where they are JSON, else their text: also for
    nesting past the parser's recursion limit and integers over int()'s 4,300 digits, which
    raised past the JSON error (a 500)."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-21C"}]
    response = httpx.post(server.url + "/tokenize", headers=server.headers,
                          json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    detok = httpx.post(server.url + "/detokenize", headers=server.headers,
                       json={"model": MODEL, "tokens": response.json()["tokens"]}).json()
    assert arguments[-40:] in detok["prompt"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strin"}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_tool_requests_get_400(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                          json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
