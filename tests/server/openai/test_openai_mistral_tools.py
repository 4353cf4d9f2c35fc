"""Mistral's tool calls: `[TOOL_CALLS]` replies parsed into OpenAI `tool_calls`, in both of
Mistral's spellings, whole and streamed, chosen by the model's chat template.

Real parts: a tiny Llama exported with a Mistral-style chat template (`[TOOL_CALLS]` in it,
and Mistral's refusal of call ids that are not nine letters and digits), served by the real
server process, called with the official `openai` client. Random weights write random text,
so the calls are forced: `tool_choice="required"` (the grammar writes Mistral's list
spelling) and a regex for the named `[ARGS]` spelling with content before it.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest

from support.openai_harness import API_KEY, MODEL, RealServer
from tokenserve.server.openai.reply_stream import ReplyStream, parse_reply
from tokenserve.server.openai.tools import ToolCallFormat

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS]"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.tool_call_id }}: "
    "{{ message.content }}[/TOOL_RESULTS]"
    "{% elif message.tool_calls %}[TOOL_CALLS][{% for call in message.tool_calls %}"
    "{% if call.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{{ {'name': call.function.name, 'arguments': call.function.arguments, "
    "'id': call.id} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Mistral's v3 conventions, short: the tools by name only (the tiny vocabulary spends a
token per 2-3 characters), calls as `[TOOL_CALLS][{...}]`, ids checked as Mistral's are."""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 6}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Oslo?"}]
LIST_CALLS = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "O]s\\"lo"}}, '
              '{"name": "get_time", "arguments": {"zone": "UTC"}}]')
NAMED_CALLS = ('Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
               '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')
CALL_ID = re.compile("[A-Za-z0-9]{9}")


def fed(text: str, size: int) -> tuple[str, dict]:
    """(content, {index: {"id", "name", "arguments"}}) of `text` streamed in pieces."""
    stream, content, calls = ReplyStream(tool_format=ToolCallFormat.MISTRAL), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        for item in delta.calls:
            call = calls.setdefault(item.index, {"id": item.id, "arguments": ""})
            call["name"] = item.function.name or call.get("name")
            call["arguments"] += item.function.arguments or ""
    return content, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_both_spellings_stream_into_calls_whatever_the_chunking(size):
    content, calls = fed(LIST_CALLS, size)
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'O]s"lo'}
    assert json.loads(calls[1]["arguments"]) == {"zone": "UTC"}
    content, calls = fed(NAMED_CALLS, size)
    assert content == "Let me look. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert all(CALL_ID.fullmatch(c["id"]) for c in calls.values())


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_text_without_calls_is_content(size):
    for text in ("plain answer", "a [TOOL] b [TOOL_CALL", "[1, 2]", '{"name": "x"}', ""):
        assert fed(text, size) == (text, {})
    # a marker that no call follows: nothing is lost
    assert fed("odd [TOOL_CALLS] end", size) == ("odd [TOOL_CALLS] end", {})


def test_whole_reply_and_format_detection():
    reasoning, content, calls = parse_reply(LIST_CALLS, ReplyStream(
        tool_format=ToolCallFormat.MISTRAL))
    assert (reasoning, content) == ("", "")
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2 and all(CALL_ID.fullmatch(c.id) for c in calls)
    assert ToolCallFormat.of_template(MISTRAL_TEMPLATE) is ToolCallFormat.MISTRAL


# -- over a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tokenizer, tmp_path_factory):
    from tokenserve.config import GenerationConfig, preset
    from tokenserve.export.exporter import export_model
    from tokenserve.model import build_model

    # 512 positions: a call written out takes about 60 of the tiny vocabulary's tokens
    architecture = dataclasses.replace(preset("tiny-llama"), max_seq_len=512)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id,
                              chat_template=MISTRAL_TEMPLATE, name="tiny-mistral")
    model_dir = export_model(build_model(architecture, seed=0), tokenizer, config,
                             tmp_path_factory.mktemp("mistral"), jit_compile=False)
    server = RealServer(model_dir)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                        timeout=120)
    server.close()


def check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and CALL_ID.fullmatch(call.id), call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_parse_and_go_back_through_the_template(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=200,
                                         parallel_tool_calls=False, temperature=1.0, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)
    # the next turn carries the calls back: Mistral's template takes their ids
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(
        model=MODEL, max_tokens=3, tools=[WEATHER, TIME], tool_choice="none",
        messages=ASK + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "21C"}])
    assert follow.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="length 9"):
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=ASK + [
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "get_time",
                                                               "arguments": "{}"}}]}])


def test_streamed_calls_reassemble(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200,
        parallel_tool_calls=False, temperature=1.0, seed=3, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        assert not chunk.choices[0].delta.content  # no [TOOL_CALLS] leaks into content
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "arguments": ""})
            call["name"] = delta.function.name or call.get("name")
            call["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1 and CALL_ID.fullmatch(calls[0]["id"])
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
    assert sum(1 for c in chunks for d in c.choices[0].delta.tool_calls or []
               if d.function.arguments) > 1  # the arguments stream


def test_named_spelling_with_content_before_it(client):
    """The v11 spelling (`name[ARGS]{...}`) after some content, forced by a regex: the
    content comes back as the message's, the call as a tool call, whole and streamed."""
    regex = r'Hi\. \[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "(UTC|CET)"\}'
    body = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                extra_body={"guided_regex": regex})
    out = client.chat.completions.create(**body)
    message = out.choices[0].message
    assert message.content == "Hi. " and out.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls)
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    chunks = list(client.chat.completions.create(stream=True, **body))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    arguments = "".join(d.function.arguments or "" for c in chunks if c.choices
                        for d in c.choices[0].delta.tool_calls or [])
    assert content == "Hi. " and arguments == message.tool_calls[0].function.arguments
