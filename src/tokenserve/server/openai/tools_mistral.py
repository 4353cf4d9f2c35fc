"""Mistral's tool calls: `[TOOL_CALLS]`, then the calls, into OpenAI tool calls.

Mistral's tokenizers spell a reply's calls in one of two ways (vLLM's `mistral` tool-call
parser reads both):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3 - v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{...}  (v11 on)

Text before the first `[TOOL_CALLS]` is content; what follows it is calls. `[TOOL_CALLS]` is a
special token of Mistral's vocabularies, so a reply parsed here is decoded with its special
tokens kept (SamplingParams.skip_special_tokens False), as vLLM does for this parser. Call ids
are nine letters and digits: Mistral's templates refuse any other id when the call comes back
in the next request's history.
"""

from __future__ import annotations

import random
import re
import string

from .markers import partial_marker_len
from .schemas import DeltaToolCall
from .tools import ToolCallStream

MARKER = "[TOOL_CALLS]"

# a list item's head: `[` (the first) or `,` after the previous item's `}`
_LIST_HEAD = re.compile(r'[\s}]*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                        r'"arguments"\s*:\s*(?=\S)')
# v11's `name[ARGS]`, perhaps after another [TOOL_CALLS] and with v13's `[CALL_ID]id`
_NAMED_HEAD = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?"
                         r"\[ARGS\]\s*(?=\S)")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine letters and digits: the only tool-call id Mistral's chat templates accept."""
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralToolCallStream(ToolCallStream):
    """ToolCallStream for Mistral's spellings: the same feed / finish / tool_calls."""

    def __init__(self, fmt):
        super().__init__(fmt)
        self.calls_start = 0  # where the text after the first [TOOL_CALLS] begins

    def _feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        content, deltas = "", []
        while True:
            if self.calls and not self.calls[-1]["done"]:
                if not self._stream_arguments(self.calls[-1], deltas):
                    return content, deltas
                continue
            if not self.in_calls:
                rest = self.text[self.pos:]
                found = rest.find(MARKER)
                if found < 0:  # content, but a suffix that may start the marker is held
                    keep = partial_marker_len(rest, MARKER)
                    content += rest[:len(rest) - keep]
                    self.pos += len(rest) - keep
                    return content, deltas
                content += rest[:found]
                self.in_calls, self.pos = True, self.pos + found + len(MARKER)
                self.calls_start = self.pos
            head = _LIST_HEAD.match(self.text, self.pos) or _NAMED_HEAD.match(self.text,
                                                                                 self.pos)
            if head is None:  # incomplete, or the calls are over: held for finish()
                return content, deltas
            self.pos = head.end()
            deltas.append(self._open_call(mistral_call_id(), head))

    def finish(self) -> str:
        """Text held back at the end that turned out to be content: a marker's start that
        never completed, or a marker that no call followed (its text, kept)."""
        if self.in_calls and self.calls:
            return ""
        start = self.calls_start - len(MARKER) if self.in_calls else self.pos
        rest, self.pos = self.text[start:], len(self.text)
        return rest
