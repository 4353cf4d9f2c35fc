"""Tool calling on chat: the grammar that forces a call, and parsing calls out of the text.

Models write calls in the Hermes style that Qwen2's template teaches (and our default
template too):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, for Llama 3 templates, as one bare JSON object `{"name": ..., "parameters": {...}}`;
Mistral's `[TOOL_CALLS]` spellings are read by tools_mistral.py.
`ToolCallStream` turns the text, as it streams, into content and OpenAI tool-call deltas
(an opening delta with id and name, then pieces of `function.arguments`).
"""

from __future__ import annotations

import enum
import json
import re
import uuid

from tokenserve.sampling import GuideKind, StructuredOutput

from .markers import partial_marker_len
from .params import bad_request
from .schemas import (DeltaFunctionCall, DeltaToolCall, FunctionCall, NamedToolChoice, Tool,
                      ToolCall)

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"
    """<tool_call>{"name", "arguments"}</tool_call> blocks (Qwen2, our default template)."""
    LLAMA3_JSON = "llama3_json"
    """One bare {"name", "parameters"} object (Llama 3.1 and later)."""
    MISTRAL = "mistral"
    """[TOOL_CALLS] and the calls (Mistral's templates; tools_mistral.py)."""

    @classmethod
    def of_template(cls, template: str | None) -> "ToolCallFormat":
        if template and "[TOOL_CALLS]" in template:
            return cls.MISTRAL
        if template and OPEN_TAG not in template and ("<|python_tag|>" in template
                                                      or '"parameters"' in template):
            return cls.LLAMA3_JSON
        return cls.HERMES

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolCallFormat.LLAMA3_JSON else "arguments"


def tool_choice_of(tools: list[Tool] | None, tool_choice) -> str | NamedToolChoice:
    """The effective tool_choice ("none", "auto", "required" or a named function) of a
    request's `tools` and `tool_choice` (chat's shape; the Responses API converts to it).

    Raises:
        InvalidRequestError: a choice that names no given tool, or tools with another
            output constraint.
    """
    tools = tools or []
    choice = tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs 'tools'.", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function '{choice.function.name}', which is "
                              f"not among the tools ({', '.join(names)}).", "tool_choice")
    return choice


def keeps_special_tokens(fmt: ToolCallFormat, tool_choice) -> bool:
    """Whether a reply parsed for calls in `fmt` must be decoded with its special tokens:
    Mistral's calls open with `[TOOL_CALLS]`, a special token of its vocabularies."""
    return fmt is ToolCallFormat.MISTRAL and tool_choice != "none"


def call_schema(tools, fmt: ToolCallFormat) -> dict:
    """JSON schema of one call object of any of `tools`."""
    key = fmt.arguments_key
    variants = [{"type": "object",
                 "properties": {"name": {"const": t.function.name},
                                key: t.function.parameters or {"type": "object",
                                                               "properties": {}}},
                 "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return schema | {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": ", "coerce_one_of": True}}


def forced_call_grammar(tools: list[Tool], choice, fmt: ToolCallFormat, parallel: bool
                        ) -> StructuredOutput | None:
    """With tool_choice "required" or a named function: a Lark grammar that admits only
    valid calls (several where `parallel`); otherwise None."""
    if choice in ("none", "auto"):
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    body = "%json " + json.dumps(call_schema(tools, fmt))
    if fmt is ToolCallFormat.MISTRAL:  # one [TOOL_CALLS] before a list of calls
        repeat = ' (", " call)*' if parallel else ""
        return StructuredOutput(GuideKind.GRAMMAR,
                                f'start: "[TOOL_CALLS][" call{repeat} "]"\ncall: {body}\n')
    if fmt is ToolCallFormat.LLAMA3_JSON:
        call = body
    else:
        call = f'"{OPEN_TAG}\\n" {body} "\\n{CLOSE_TAG}"'
    repeat = ' ("\\n" call)*' if parallel else ""
    return StructuredOutput(GuideKind.GRAMMAR, f"start: call{repeat}\ncall: {call}\n")


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as HF chat templates take them ([{"type": "function", "function": {...}}])."""
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in tools]


_HEAD = re.compile(r'\s*(?:<tool_call>)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                   r'"(?:arguments|parameters)"\s*:\s*(?=\S)')
_BETWEEN = re.compile(r"[\s}]*(?:</tool_call>)?[\s;]*")
"""What may stand between one call's arguments and the next call's head."""


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at text[start], or None while incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and ch in ",}\n ":
            return i
    return None


class ToolCallStream:
    """Splits one choice's text into content and tool calls as it streams.

    `feed(delta)` returns (content delta, tool-call deltas); `finish()` returns what was held
    back. Text that starts a call is held back until it is clearly one or clearly not.
    """

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.text = ""
        self.pos = 0            # text[:pos] is handled
        self.calls: list[dict] = []  # {"id", "name", "args_start", "emitted", "done"}
        self.in_calls = False

    def _opener_possible(self, rest: str) -> bool:
        """`rest` could still grow into a call's head (compared without whitespace)."""
        norm = re.sub(r"\s+", "", rest)
        heads = ['{"name":"'] if self.fmt is ToolCallFormat.LLAMA3_JSON else [
            OPEN_TAG + '{"name":"', '{"name":"']
        return any(h.startswith(norm) or norm.startswith(h) for h in heads)

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        content, deltas = self._feed(delta)
        merged: list[DeltaToolCall] = []
        for item in deltas:  # one entry per call and chunk: a head and its first arguments
            if merged and merged[-1].index == item.index:
                last = merged[-1].function
                last.arguments = (last.arguments or "") + (item.function.arguments or "")
            else:
                merged.append(item)
        return content, merged

    def _feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        content, deltas = "", []
        while True:
            if self.calls and not self.calls[-1]["done"]:
                if not self._stream_arguments(self.calls[-1], deltas):
                    return content, deltas
                continue
            start = _BETWEEN.match(self.text, self.pos).end() if self.in_calls else self.pos
            head = _HEAD.match(self.text, start)
            rest = self.text[self.pos:]
            if head:
                self.in_calls, self.pos = True, head.end()
                deltas.append(self._open_call(f"call_{uuid.uuid4().hex[:24]}", head))
                continue
            if self.in_calls:  # after the calls: anything else is held for finish()
                return content, deltas
            if self.fmt is ToolCallFormat.HERMES:
                tag = rest.find(OPEN_TAG)
                if tag > 0:  # content before a call
                    content += rest[:tag]
                    self.pos += tag
                    continue
                if tag < 0:  # hold back a suffix that may start the tag
                    keep = partial_marker_len(rest, OPEN_TAG)
                    if not (self.pos == 0 and self._opener_possible(rest)):
                        content += rest[:len(rest) - keep]
                        self.pos += len(rest) - keep
                    return content, deltas
                return content, deltas  # "<tool_call>" at pos, head still incomplete
            if self.pos == 0 and self._opener_possible(rest):
                return content, deltas
            content += rest
            self.pos = len(self.text)
            return content, deltas

    def _open_call(self, call_id: str, head: re.Match) -> DeltaToolCall:
        """Starts the call whose head `head` matched (group 1: its JSON-escaped name; its
        arguments begin where the head ends); returns its first delta: id, type and name."""
        self.calls.append({"id": call_id, "name": json.loads(f'"{head.group(1)}"'),
                           "args_start": head.end(), "emitted": 0, "done": False})
        return DeltaToolCall(index=len(self.calls) - 1, id=call_id, type="function",
                             function=DeltaFunctionCall(name=self.calls[-1]["name"],
                                                        arguments=""))

    def _stream_arguments(self, call: dict, deltas: list) -> bool:
        """Adds the call's arguments so far to `deltas`; True once they are complete."""
        end = json_end(self.text, call["args_start"])
        stop = len(self.text) if end is None else end
        piece = self.text[call["args_start"] + call["emitted"]:stop]
        if piece:
            call["emitted"] += len(piece)
            deltas.append(DeltaToolCall(index=len(self.calls) - 1,
                                        function=DeltaFunctionCall(arguments=piece)))
        if end is None:
            return False
        call["done"], self.pos = True, end
        return True

    def finish(self) -> str:
        """Text held back at the end that turned out to be content (none after calls)."""
        if self.in_calls:
            return ""
        rest, self.pos = self.text[self.pos:], len(self.text)
        return rest

    def tool_calls(self) -> list[ToolCall]:
        """The calls found so far, with their whole arguments."""
        calls = []
        for call in self.calls:
            start = call["args_start"]
            end = json_end(self.text, start) if call["done"] else None
            calls.append(ToolCall(id=call["id"], function=FunctionCall(
                name=call["name"], arguments=self.text[start:end or len(self.text)])))
        return calls


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole choice's text."""
    stream = ToolCallStream(fmt)
    content, _ = stream.feed(text)
    content += stream.finish()
    calls = stream.tool_calls()
    return (content or None) if calls else content, calls
