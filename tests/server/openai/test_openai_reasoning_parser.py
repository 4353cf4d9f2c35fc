"""The reasoning parser on its own: a reply split at every place a stream may split it gives
what the whole reply gives; where a reply begins is read from the prompt; calls inside the
think block are not made. Plain Python, no engine (the served path is in
test_openai_reasoning.py beside it)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tokenserve.server.openai.reasoning import (REASONING_PARSERS, ReasoningStream,
                                                reasoning_format, split_reasoning)
from tokenserve.server.openai.reply_stream import ReplyStream, parse_reply
from tokenserve.server.openai.responses_input import input_messages
from tokenserve.server.openai.responses_schemas import ResponseCreateRequest
from tokenserve.server.openai.tools import ToolCallFormat

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]

# (reply, begins inside the block, (reasoning, content))
CASES = [
    ("<think>\nhm, ok\n</think>\n\nParis.", False, ("hm, ok", "Paris.")),
    ("  <think>a  b </think>  c ", False, ("a  b", "c ")),
    ("Paris.", False, ("", "Paris.")),
    ("Paris.", True, ("Paris.", "")),  # cut off before its end tag: all reasoning
    ("<think>\n\n</think>\n\nhi", False, ("", "hi")),
    ("<think>abc </th", False, ("abc </th", "")),  # a tag that never completed is text
    ("<thi", False, ("", "<thi")),
    ("x<think>a</think>", False, ("", "x<think>a</think>")),  # a start tag only at the start
    ("<think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),
    ("<think>a <thinker> b</think>c", False, ("a <thinker> b", "c")),
    ("<think>\nrepeated</think>ok", True, ("repeated", "ok")),  # the prompt's tag, written again
    ("abc\n</think>\ndef", True, ("abc", "def")),
    ("</think>after", False, ("", "</think>after")),
    ("", True, ("", "")),
]


def splits(text: str, rng: random.Random, count: int = 200):
    """Every split of a short text into pieces, or `count` random ones of a longer text."""
    cuts = range(1, len(text))
    if len(text) <= 10:
        for k in range(len(text)):
            for chosen in itertools.combinations(cuts, k):
                yield [text[i:j] for i, j in zip((0, *chosen), (*chosen, len(text)))]
        return
    for _ in range(count):
        chosen = sorted(rng.sample(cuts, rng.randint(1, min(8, len(text) - 1))))
        yield [text[i:j] for i, j in zip((0, *chosen), (*chosen, len(text)))]


@pytest.mark.parametrize("text, in_reasoning, expected", CASES)
def test_any_split_of_a_reply_gives_what_the_whole_gives(text, in_reasoning, expected):
    assert split_reasoning(text, QWEN3, in_reasoning) == expected
    for pieces in splits(text, random.Random(text)):
        stream, reasoning, content = ReasoningStream(QWEN3, in_reasoning), "", ""
        for piece in pieces:
            more_reasoning, more_content = stream.feed(piece)
            reasoning, content = reasoning + more_reasoning, content + more_content
        more_reasoning, more_content = stream.finish()
        assert (reasoning + more_reasoning, content + more_content) == expected, pieces


def test_tags_split_across_tokens_are_held_then_handed_out():
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>\nlet me") == ("let me", "")
    assert stream.feed(" see\n</thi") == (" see", "")  # the newline may precede the end tag
    assert stream.feed("nk>\n\nYes") == ("", "Yes")
    assert stream.finish() == ("", "")


@pytest.mark.parametrize("prompt, qwen3, deepseek_r1", [
    ("<|assistant|>", False, True),                     # nothing said: the family's default
    ("<|assistant|><think>\n", True, True),             # the prompt opened the block
    ("<|assistant|><think>\n\n</think>\n\n", False, False),  # it closed an empty one
    ("<think>old</think>answer<|user|>hi<|assistant|>", False, True),  # an earlier turn's
])
def test_where_a_reply_begins_is_read_from_the_prompt(prompt, qwen3, deepseek_r1):
    assert QWEN3.opens_in_reasoning(prompt) is qwen3
    assert R1.opens_in_reasoning(prompt) is deepseek_r1


def test_auto_picks_a_parser_for_templates_that_think_only():
    assert reasoning_format("auto", "{{ '<think>' }}{{ messages }}") is QWEN3
    assert reasoning_format("auto", "{{ messages }}") is None
    assert reasoning_format("auto", None) is None
    assert reasoning_format("none", "<think>") is None
    assert reasoning_format("deepseek_r1", None) is R1


def test_a_call_written_while_thinking_is_not_made():
    thought = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    reply = f'<think>{thought}</think>\n<tool_call>\n{{"name": "g", "arguments": {{}}}}\n' \
            f'</tool_call>'
    reasoning, content, calls = parse_reply(reply, ReplyStream(QWEN3, False,
                                                               ToolCallFormat.HERMES))
    assert reasoning == thought and content == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("g", {})]
    stream, names = ReplyStream(QWEN3, False, ToolCallFormat.HERMES), []
    for i in range(0, len(reply), 3):
        names += [c.function.name for c in stream.feed(reply[i:i + 3]).calls if c.function.name]
    names += [c.function.name for c in stream.feed("", final=True).calls if c.function.name]
    assert names == ["g"]


def test_a_reasoning_input_item_goes_to_the_assistant_turn_after_it():
    body = ResponseCreateRequest(input=[
        {"role": "user", "content": "A city?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "France, say."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Paris"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
        {"role": "user", "content": "And?"}])
    messages, listed = input_messages(body)
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "France, say."), ("tool", None), ("user", None)]
    assert [item["type"] for item in listed] == ["message", "reasoning", "function_call",
                                                 "function_call_output", "reasoning",
                                                 "message"]
    assert listed[1]["id"] == "rs_1" and listed[4]["id"].startswith("rs_")
