"""One chat reply's text, as it streams, split into reasoning, content and tool calls.

The reasoning comes first and is taken out before tool calls are looked for, so a call the
model only thought about is not made: calls are parsed from the content after the think block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningFormat, ReasoningStream
from .schemas import DeltaToolCall, ToolCall
from .tools import ToolCallFormat, ToolCallStream
from .tools_mistral import MistralToolCallStream


@dataclass
class ReplyDelta:
    """What a piece of the reply added: reasoning text, content text, tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ReplyStream:
    """Splits one reply as it streams: `feed` each text delta, the last one with `final`.

    Args:
        reasoning: the model's reasoning format, or None: no reasoning is looked for.
        in_reasoning: the reply begins inside a think block (ReasoningFormat.opens_in_reasoning).
        tool_format: the format calls are parsed in, or None: the content is left as it is.
    """

    def __init__(self, reasoning: ReasoningFormat | None = None, in_reasoning: bool = False,
                 tool_format: ToolCallFormat | None = None):
        self.reasoning = None if reasoning is None else ReasoningStream(reasoning, in_reasoning)
        self.tools = None if tool_format is None else tool_call_stream(tool_format)

    def feed(self, text: str, final: bool = False) -> ReplyDelta:
        """What `text`, the reply's next piece, adds; with `final` (the reply's last piece,
        perhaps ""), also what was held back."""
        if self.reasoning is None:
            reasoning, content = "", text
        else:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return ReplyDelta(reasoning, content)
        content, calls = self.tools.feed(content) if content else ("", [])
        if final:
            content += self.tools.finish()
        return ReplyDelta(reasoning, content, calls)

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def tool_calls(self) -> list[ToolCall]:
        """The calls found so far, with their whole arguments."""
        return [] if self.tools is None else self.tools.tool_calls()


def tool_call_stream(fmt: ToolCallFormat) -> ToolCallStream:
    """The parser of calls written in `fmt`."""
    return MistralToolCallStream(fmt) if fmt is ToolCallFormat.MISTRAL else ToolCallStream(fmt)


def parse_reply(text: str, stream: ReplyStream) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of a whole reply, through a new `stream`."""
    whole = stream.feed(text, final=True)
    return whole.reasoning, whole.content, stream.tool_calls()
