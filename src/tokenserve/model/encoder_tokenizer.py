"""An encoder's tokenizer (HF `tokenizers`, `tokenizer.json`): text, or a (query, document)
pair, to token ids with the model's special tokens and token types ([CLS] a [SEP] b [SEP]).

The file's own truncation and padding settings are switched off: the server decides what is
too long (a 400, or `truncate_prompt_tokens`), and the batcher pads."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from tokenserve.encoder_config import EncodedInput


class EncoderTokenizer:
    """Text and text pairs -> `EncodedInput`, special tokens included.

    Example:
        >>> tokenizer = EncoderTokenizer.load("model/tokenizer.json")
        >>> tokenizer.encode("hello").token_ids          # [101, 7592, 102]
        >>> tokenizer.encode_pair("q", "d").type_ids     # [0, 0, 0, 1, 1]
    """

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        self.hf.no_truncation()
        self.hf.no_padding()

    @classmethod
    def load(cls, path: str | Path) -> "EncoderTokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, max_tokens: int | None = None) -> EncodedInput:
        """`text` with the model's special tokens; with `max_tokens`, its first tokens cut so
        that the whole fits (the special tokens kept, as sentence-transformers truncates)."""
        return self._encode(text, None, max_tokens)

    def encode_pair(self, first: str, second: str,
                    max_tokens: int | None = None) -> EncodedInput:
        """The pair as a cross-encoder reads it; with `max_tokens`, the longer text is cut
        first (the tokenizers' longest-first strategy, as transformers truncates pairs)."""
        return self._encode(first, second, max_tokens)

    def _encode(self, first: str, second: str | None, max_tokens: int | None) -> EncodedInput:
        # Truncated by hand rather than by enable_truncation(): that setting is the shared
        # tokenizer's, and requests encode on several threads at once.
        a = self.hf.encode(first, add_special_tokens=False)
        b = None if second is None else self.hf.encode(second, add_special_tokens=False)
        if max_tokens is not None:
            budget = max(max_tokens - self.hf.num_special_tokens_to_add(b is not None), 0)
            keep_a, keep_b = _longest_first(len(a.ids), 0 if b is None else len(b.ids), budget)
            a.truncate(keep_a)
            if b is not None:
                b.truncate(keep_b)
        encoding = self.hf.post_process(a, b, add_special_tokens=True)
        return EncodedInput(list(encoding.ids), list(encoding.type_ids))

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)


def _longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """How many tokens of each text to keep so both fit `budget`, trimming the longer one
    first (transformers' longest_first)."""
    while len_a + len_b > budget:
        if len_a >= len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b
