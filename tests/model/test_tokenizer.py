"""Byte-level BPE: lossless round trips and streaming that never splits a character."""

from tokenserve.model.tokenizer import Tokenizer

SAMPLE = "def f(x):\n\treturn x  # ünïcödé ✓ 日本語 🐍\n\n    spaces   and\ttabs\r\n"


def test_round_trip_is_lossless_for_unicode_and_whitespace(tokenizer):
    assert tokenizer.decode(tokenizer.encode(SAMPLE)) == SAMPLE


def test_special_tokens_are_distinct_and_skipped_in_text(tokenizer):
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert len(specials) == 3
    ids = [tokenizer.bos_token_id, *tokenizer.encode("x = 1"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids) == "x = 1"


def test_stream_yields_whole_characters_only(tokenizer):
    ids = tokenizer.encode(SAMPLE)
    pieces = list(tokenizer.stream(ids))
    assert "".join(pieces) == SAMPLE
    assert all("\ufffd" not in piece for piece in pieces)


def test_save_and_load_keep_ids(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    again = Tokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode(SAMPLE) == tokenizer.encode(SAMPLE)
    assert again.eos_token_id == tokenizer.eos_token_id
