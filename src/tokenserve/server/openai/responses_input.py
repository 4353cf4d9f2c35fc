"""A Responses API request's `input` as chat messages, and the items the API lists for it.

Messages are the plain dicts chat templates take. Function calls the client sends back become
an assistant message's "tool_calls", and their results tool messages, as in chat completions.
"""

from __future__ import annotations

import secrets

from .http import validated
from .params import bad_request
from .responses_schemas import (INPUT_ITEMS, INPUT_ROLES, FunctionCallInput,
                                FunctionCallOutputInput, ReasoningInput,
                                ResponseCreateRequest)


def new_id(prefix: str) -> str:
    """An object id the way OpenAI writes them: a type prefix ("resp", "msg", "fc" ...)
    and 192 random bits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_parts(content, where: str) -> list[dict]:
    """A message's or a call output's content as text parts.

    Raises:
        InvalidRequestError: a part that is not text.
    """
    parts = ([{"type": "input_text", "text": content}] if isinstance(content, str) else
             [part.model_dump(exclude_none=True) for part in content])
    for j, part in enumerate(parts):
        if part["type"] not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.{j}: only text content is served.", f"{where}.{j}",
                              "unsupported_parameter")
    return parts


def _call_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or ()}


def input_messages(body: ResponseCreateRequest, history: list[dict] = (),
                   takes_reasoning: bool = True) -> tuple[list[dict], list[dict]]:
    """(chat messages, input items as the API lists them) of a request's `input`.

    Messages are plain dicts as chat templates take them: {"role", "content"}, with
    "tool_calls" on an assistant message (function_call items, consecutive ones merged into
    one message, as chat completions send them) and "tool_call_id" on a tool message
    (function_call_output). A reasoning item's text becomes the "reasoning_content" of the
    assistant message that follows it. `history` is the stored conversation the input
    continues. `takes_reasoning`: the model's replies carry reasoning, so reasoning items are
    served (as OpenAI's API, which refuses them for a model that does not reason).

    Raises:
        InvalidRequestError: an item of a type not served, an unsupported role or content
            part, or a function_call_output whose call_id no call in the conversation has.
    """
    if isinstance(body.input, str):
        body_items = [{"role": "user", "content": body.input}]
    else:
        body_items = body.input
    messages, listed = [], []
    known_calls = _call_ids(history)
    reasoning = None  # a reasoning item's text, for the assistant message that follows

    def assistant(message: dict) -> None:
        nonlocal reasoning
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)

    for i, raw in enumerate(body_items):
        if not isinstance(raw, dict):
            raise bad_request(f"input.{i}: an input item must be an object.", f"input.{i}",
                              "invalid_type")
        kind = raw.get("type", "message")
        if kind not in INPUT_ITEMS:
            raise bad_request(f"input.{i}.type: input items of type '{kind}' are not served; "
                              f"use one of {', '.join(INPUT_ITEMS)}.", f"input.{i}.type",
                              "unsupported_parameter")
        if kind == "reasoning" and not takes_reasoning:
            raise bad_request(f"input.{i}.type: reasoning items can only be given to a model "
                              f"whose replies carry reasoning; remove them from the input.",
                              f"input.{i}.type", "unsupported_parameter")
        item = validated(INPUT_ITEMS[kind], raw, f"input.{i}")
        if isinstance(item, ReasoningInput):  # it begins an assistant turn
            reasoning = "".join(part.text or "" for part in item.content or item.summary)
            listed.append({**item.model_dump(exclude_none=True), "id": item.id or new_id("rs"),
                           "status": "completed"})
            continue
        if isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(item.call_id)
            listed.append({"id": item.id or new_id("fc"), "type": "function_call",
                           "call_id": item.call_id, "name": item.name,
                           "arguments": item.arguments, "status": "completed"})
            continue
        if isinstance(item, FunctionCallOutputInput):
            if item.call_id not in known_calls:
                raise bad_request(f"input.{i}.call_id: no function call with call_id "
                                  f"'{item.call_id}' in this conversation.",
                                  f"input.{i}.call_id")
            parts = _text_parts(item.output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": "".join(part["text"] for part in parts)})
            listed.append({"id": item.id or new_id("fco"), "type": "function_call_output",
                           "call_id": item.call_id, "output": item.output if isinstance(
                               item.output, str) else parts, "status": "completed"})
            continue
        if item.role not in INPUT_ROLES:
            raise bad_request(f"input.{i}.role: role '{item.role}' is not supported; use "
                              f"one of {', '.join(INPUT_ROLES)}.", f"input.{i}.role")
        parts = _text_parts(item.content, f"input.{i}.content")
        text = "".join(part["text"] for part in parts)
        if item.role == "assistant":
            assistant({"role": "assistant", "content": text})
        else:  # a reasoning item not followed by its answer is dropped
            reasoning = None
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": text})
        listed.append({"id": new_id("msg"), "type": "message", "status": "completed",
                       "role": item.role, "content": parts})
    return messages, listed


def drop_oldest_turn(conversation: list[dict]) -> list[dict]:
    """The conversation without its oldest turn (truncation "auto"): the first message, then
    every message before the next user message, so that no tool result is left without its
    call and the templates that want turns to alternate still get a user message first. The
    last message always stays."""
    kept = conversation[1:]
    while len(kept) > 1 and kept[0]["role"] != "user":
        kept = kept[1:]
    return kept
