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


def row_buckets(max_rows: int) -> list[int]:
    """The row counts batches are padded to: 1, 4, 16, 64, ... below max_rows, and max_rows.
    Few, so that warm-up can compile every one-sentence shape (a shape first met while
    serving costs its batch a compile: seconds on a busy 2-core VM); a batch pads at most
    4x its rows, and only a batch of few rows, which is cheap."""
    buckets, rows = [], 1
    while rows < max_rows:
        buckets.append(rows)
        rows *= 4
    return buckets + [max_rows]


def row_bucket(num_rows: int, max_rows: int) -> int:
    """The smallest of row_buckets(max_rows) >= num_rows (num_rows itself beyond them)."""
    return next((b for b in row_buckets(max_rows) if b >= num_rows), num_rows)
