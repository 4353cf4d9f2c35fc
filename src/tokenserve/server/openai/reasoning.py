"""Reasoning output: what a thinking model writes inside <think>…</think>, apart from its answer.

A chat reply of a model whose template thinks (Qwen3, DeepSeek-R1, QwQ, SmolLM3) reads

    <think>
    The user wants a city. Paris is one.
    </think>

    Paris.

and is answered, as vLLM and llama.cpp's server answer it, as `reasoning_content` ("The user
wants a city. Paris is one.") and `content` ("Paris."), with no tags in either. Which parser a
model gets is the server's `--reasoning_parser` (vLLM's names); `auto`, the default, gives one
to a model whose chat template writes `<think>` and none to any other, whose replies then carry
no `reasoning_content` at all.

Where the reply begins is read from the rendered prompt: a generation prompt that opens a
think block (DeepSeek-R1's, Qwen3's thinking-only models') starts the reply inside it, and one
that closes an empty block (Qwen3 with `enable_thinking: false`) starts it in the answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenserve.errors import ConfigError

from .markers import partial_marker_len

AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its reasoning."""

    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    starts_in_reasoning: bool = False
    """Where a reply begins when its prompt neither opens nor just closed a think block: True
    for models that always think and may leave out the opening tag (DeepSeek-R1); False for
    those that think only when they write the tag (Qwen3's hybrid models)."""

    def opens_in_reasoning(self, prompt: str) -> bool:
        """Whether a reply to the rendered `prompt` begins inside its reasoning."""
        start, end = prompt.rfind(self.start_tag), prompt.rfind(self.end_tag)
        if start > end:  # the generation prompt opened the block
            return True
        if end >= 0 and not prompt[end + len(self.end_tag):].strip():
            return False  # it closed an empty one: thinking is off
        return self.starts_in_reasoning


REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
}
"""The parsers `--reasoning_parser` names, as vLLM names them."""
PARSER_NAMES = (AUTO, NONE, *REASONING_PARSERS)


def check_parser_name(name: str) -> None:
    """Raises ConfigError unless `name` is one `--reasoning_parser` takes."""
    if name not in PARSER_NAMES:
        raise ConfigError(f"--reasoning_parser {name!r} is not a reasoning parser; use one of "
                          f"{', '.join(PARSER_NAMES)}")


def reasoning_format(name: str, chat_template: str | None) -> ReasoningFormat | None:
    """The format a model's replies are parsed with: `name`'s, or with `auto` qwen3's for a
    chat template that writes `<think>` (the R1-style templates that open the block in the
    prompt are covered by reading the prompt), else None: no reasoning is looked for."""
    if name == AUTO:
        return REASONING_PARSERS["qwen3"] if chat_template and "<think>" in chat_template \
            else None
    return REASONING_PARSERS.get(name)


class _State(enum.Enum):
    BEFORE = "before"        # only whitespace yet: a start tag may still come
    OPENING = "opening"      # the prompt opened the block; the model may repeat the start tag
    REASONING = "reasoning"  # inside the block: the end tag ends it
    CLOSED = "closed"        # just past the end tag: whitespace before the answer is dropped
    CONTENT = "content"      # the answer


class ReasoningStream:
    """Splits one reply's text into reasoning and content as it streams.

    `feed(delta)` returns (reasoning delta, content delta); `finish()` returns what was held
    back. A tag split across deltas is held until it is whole or clearly not a tag, and the
    whitespace around the tags is dropped, so the pieces of any split of a text join to what
    the whole text gives. A start tag counts only at the very beginning of the reply (after
    whitespace), and only the first think block is reasoning. A reply cut off before its end
    tag is all reasoning.

    Example:
        stream = ReasoningStream(REASONING_PARSERS["qwen3"])
        stream.feed("<thi")              # ("", ""): held
        stream.feed("nk>\nhm</think>ok")  # ("hm", "ok")
    """

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False):
        self.fmt = fmt
        self.state = _State.OPENING if in_reasoning else _State.BEFORE
        self.held = ""  # text not yet handed out: whitespace or a tag's first characters
        self._shown_reasoning = False  # reasoning's leading whitespace is behind us

    def feed(self, delta: str) -> tuple[str, str]:
        text, reasoning, content = self.held + delta, "", ""
        self.held = ""
        start, end = self.fmt.start_tag, self.fmt.end_tag
        while text:
            if self.state in (_State.BEFORE, _State.OPENING):
                stripped = text.lstrip()
                if stripped.startswith(start):
                    self.state, text = _State.REASONING, stripped[len(start):]
                elif start.startswith(stripped):  # whitespace, or the tag's beginning
                    self.held = text
                    break
                else:
                    self.state = _State.REASONING if self.state is _State.OPENING \
                        else _State.CONTENT
            elif self.state is _State.REASONING:
                if not self._shown_reasoning:
                    text = text.lstrip()
                at = text.find(end)
                if at >= 0:
                    reasoning += text[:at].rstrip()
                    self.state, text = _State.CLOSED, text[at + len(end):]
                    continue
                keep = partial_marker_len(text, end)
                shown = text[:len(text) - keep].rstrip()  # trailing whitespace may end it
                reasoning += shown
                self._shown_reasoning |= bool(shown)
                self.held = text[len(shown):]
                break
            elif self.state is _State.CLOSED:
                text = text.lstrip()
                if text:
                    self.state = _State.CONTENT
            else:
                content, text = content + text, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply: a tag that never completed is text,
        and whitespace at the end of the reasoning is dropped."""
        held, self.held = self.held, ""
        if self.state is _State.BEFORE:
            return "", held
        if self.state is _State.OPENING or (self.state is _State.REASONING
                                             and not self._shown_reasoning):
            return held.strip(), ""
        if self.state is _State.REASONING:
            return held.rstrip(), ""
        return "", ""


def split_reasoning(text: str, fmt: ReasoningFormat, in_reasoning: bool = False
                    ) -> tuple[str, str]:
    """(reasoning, content) of a whole reply; reasoning is "" when it has none."""
    stream = ReasoningStream(fmt, in_reasoning)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content
