"""Incremental detokenizing with stop strings, including stops that span token boundaries.

Text is held back while it could still be the start of a stop string, and while its last
UTF-8 character is incomplete, so a streamed client never receives text it must retract.

Each token decodes only a short window, as vLLM and TGI do: the tokens not yet turned into
text plus the few before them (for context: some decoders drop a leading space at the start
of a decode). New text is the window's text minus the text of its already-read part, so the
cost per token stays flat however long the output grows (decoding every output id again on
every token would be O(n^2) per sequence).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas and finds stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        # only a request that keeps special tokens passes the flag: any tokenizer decodes
        self.decode_options = {} if skip_special_tokens else {"skip_special_tokens": False}
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.output_ids: list[int] = []
        self.text = ""
        self.num_emitted = 0  # characters of self.text already handed out
        self.prefix_offset = 0  # output_ids[prefix_offset:read_offset]: context, already text
        self.read_offset = 0  # output_ids[read_offset:]: not yet text

    def append(self, token_id: int) -> tuple[str, str | None]:
        """Adds a token; returns (new text to emit, the stop string matched or None)."""
        ids = self.output_ids
        ids.append(token_id)
        window = self.tokenizer.decode(ids[self.prefix_offset:], **self.decode_options)
        if window.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return "", None
        read = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset],
                                     **self.decode_options)
        self.text += window[len(read):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        text = self.text
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
