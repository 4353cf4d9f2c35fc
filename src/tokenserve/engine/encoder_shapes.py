"""The static shapes encoder batches are padded to (plain Python): each compiled program
serves one (rows, length) bucket, so a server compiles a few programs, not one per batch."""

from __future__ import annotations

MIN_LENGTH_BUCKET = 16
"""Shortest length bucket: most one-sentence inputs (10-16 tokens) share it."""


def length_bucket(num_tokens: int, max_len: int | None = None) -> int:
    """num_tokens rounded up to 16, 24, 32, 48, 64, 96, 128, ... (powers of two and the
    midpoints between them: at most a third of a batch is padding), at most max_len."""
    bucket = MIN_LENGTH_BUCKET
    while bucket < num_tokens:
        power = 1 << (bucket.bit_length() - 1)
        bucket = power + power // 2 if bucket == power else 2 * power
    return bucket if max_len is None else max(min(bucket, max_len), num_tokens)


def row_bucket(num_rows: int) -> int:
    """The next power of two >= num_rows."""
    return 1 << max(num_rows - 1, 0).bit_length()
