"""Engine outputs to OpenAI pieces: token strings, the two logprobs formats, SSE events."""

from __future__ import annotations

import json
import math

from pydantic import BaseModel

from tokenserve.engine.outputs import TokenLogprob

from .schemas import ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0
"""-inf (a token the sampler ruled out) as a JSON number, as vLLM sends it."""


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def token_text(tokenizer, token_id: int) -> str:
    """One token as text; a token that is part of a multi-byte character decodes to U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobsBuilder:
    """Completions-format logprobs of one choice, with text offsets counted across deltas."""

    def __init__(self, tokenizer, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = start_offset

    def delta(self, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        """The logprobs of tokens generated since the last call."""
        out = CompletionLogprobs()
        for entry in logprobs:
            text = token_text(self.tokenizer, entry.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(entry.logprob))
            # keyed by text: two tokens that decode alike (halves of one character) share a
            # key, which keeps the likelier one's logprob (`top` is likeliest first)
            top: dict[str, float] = {}
            for t, lp in entry.top:
                top.setdefault(token_text(self.tokenizer, t), _finite(lp))
            out.top_logprobs.append(top or None)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def extend(total: CompletionLogprobs, part: CompletionLogprobs) -> None:
        total.tokens += part.tokens
        total.token_logprobs += part.token_logprobs
        total.top_logprobs += part.top_logprobs
        total.text_offset += part.text_offset


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Chat-format logprobs: token, logprob, UTF-8 bytes and top alternatives per token."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

    return [ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                             top_logprobs=[top(t, lp) for t, lp in e.top])
            for e in logprobs]


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
