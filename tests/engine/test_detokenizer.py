"""Incremental detokenizing: exact text, whole characters, stop strings, flat cost per token."""

from __future__ import annotations

import numpy as np

from tokenserve.engine.detokenizer import IncrementalDetokenizer

SAMPLE = "def f(x):\n\treturn x  # ünïcödé ✓ 日本語 🐍\n\n    spaces   and\ttabs\r\n" * 3


class CountingTokenizer:
    """The real tokenizer, counting how many token ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.num_decoded_ids = tokenizer, 0

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        token_ids = list(token_ids)
        self.num_decoded_ids += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens)


def stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for token in ids:
        text, matched = detok.append(token)
        pieces.append(text)
        if matched is not None:
            return pieces, matched
    return pieces + [detok.flush()], None


def test_deltas_join_to_the_full_decode_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(SAMPLE)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == SAMPLE
    assert all("\ufffd" not in piece for piece in pieces)


def test_random_token_ids_decode_like_a_full_decode(tokenizer):
    rng = np.random.default_rng(0)
    vocab = tokenizer.vocab_size
    for _ in range(5):
        ids = [int(t) for t in rng.integers(0, vocab, 300)]
        pieces, _ = stream(tokenizer, ids)
        text = "".join(pieces)
        full = tokenizer.decode(ids)
        # random byte tokens can leave invalid UTF-8 that a full decode replaces: compare
        # with those replacement characters dropped
        assert text.replace("\ufffd", "") == full.replace("\ufffd", "")


def test_a_stop_string_cuts_the_text_where_it_starts(tokenizer):
    ids = tokenizer.encode(SAMPLE)
    pieces, matched = stream(tokenizer, ids, stop=("日本",))
    assert matched == "日本"
    assert "".join(pieces) == SAMPLE[:SAMPLE.index("日本")]


def test_the_cost_per_token_stays_flat_as_the_output_grows(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(SAMPLE * 20)
    assert len(ids) > 2000
    stream(counting, ids)
    # decoding the whole output on every token would pass ~len(ids)**2 / 2 ids
    assert counting.num_decoded_ids < 10 * len(ids)


def test_special_tokens_are_dropped_unless_the_request_keeps_them(tokenizer):
    """A reply parsed for calls that open with a special token (Mistral's [TOOL_CALLS]) is
    decoded with its special tokens; every other reply without them."""
    special = tokenizer.bos_token_id
    ids = tokenizer.encode("abc") + [special] + tokenizer.encode(" def")
    marker = tokenizer.decode([special], skip_special_tokens=False)
    assert marker  # the tiny tokenizer's <|bos|>
    dropped = IncrementalDetokenizer(tokenizer)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    texts = ["".join(d.append(t)[0] for t in ids) + d.flush() for d in (dropped, kept)]
    assert texts == [tokenizer.decode(ids), tokenizer.decode(ids, skip_special_tokens=False)]
    assert marker not in texts[0] and marker in texts[1]
