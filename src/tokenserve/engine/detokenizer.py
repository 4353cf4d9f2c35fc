"""Incremental detokenizing with stop strings, including stops that span token boundaries.

Text is held back while it could still be the start of a stop string, and while its last
UTF-8 character is incomplete, so a streamed client never receives text it must retract.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas and finds stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.output_ids: list[int] = []
        self.text = ""
        self.num_emitted = 0  # characters of self.text already handed out

    def append(self, token_id: int) -> tuple[str, str | None]:
        """Adds a token; returns (new text to emit, the stop string matched or None)."""
        self.output_ids.append(token_id)
        text = self.tokenizer.decode(self.output_ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return "", None
        self.text = text
        if self.stop:
            start = max(0, self.num_emitted - self.max_stop_len)
            hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                cut, matched = min(hits)
                self.text = text[:cut]
                return self._emit(len(self.text)), matched
            return self._emit(max(self.num_emitted, len(text) - self.max_stop_len + 1)), None
        return self._emit(len(text)), None

    def flush(self) -> str:
        """Everything held back, when the sequence ends without a stop string."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.num_emitted:upto]
        self.num_emitted = max(self.num_emitted, upto)
        return delta
