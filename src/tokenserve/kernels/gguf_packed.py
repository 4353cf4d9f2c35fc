"""GGUF Q4_0, Q4_1 and Q5_0 weights repacked into 8-row tiles ("q4_0x8", "q4_1x8", "q5_0x8"),
the layout `gguf_packed.h`'s kernel reads: eight rows' block b side by side, their scales in
one vector's lanes, so a decode step's dot products with eight rows share each activation
block's loads and land in one vector (the header says why that is faster).

The repacking is done at load (model/gguf_packing.py) and never stored: an export keeps the
file's own rows, so stock TensorFlow and TF Serving read it as before. A packed tensor has the
same shape and bytes as the rows it came from ([N, row bytes], N a multiple of 8): tile t is
rows 8t .. 8t + 7's bytes, reordered. `pack_rows` writes it (NumPy, once per layer);
`unpack_rows` undoes it in TensorFlow, for the pure-TF dequantize path.

A tile's block b, 8 x the type's bytes (fp16 fields little-endian, as in the file):
    d        8 scales, row r's at 2r
    m        Q4_1: 8 offsets
    qh       Q5_0: 8 uint32; vector v's bit 4r + k is row r's value 4v + k's fifth bit
    nibbles  4 chunks of 32 bytes; chunk j holds row r's nibble bytes 4j .. 4j + 3 at 4r
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.kernels.gguf_types import BLOCK_SIZES

TILE_ROWS = 8

PACKED = {"q4_0x8": "q4_0", "q4_1x8": "q4_1", "q5_0x8": "q5_0"}
"""Packed type -> the file's type it holds."""

PACKABLE = {base: packed for packed, base in PACKED.items()}
"""The file's types that the packed kernel reads -> their packed type."""


def _fields(base: str) -> list[tuple[str, int, int]]:
    """(field, start, end) of a block of `base`: d, then m (Q4_1) or qh (Q5_0), then nibbles."""
    size = BLOCK_SIZES[base][1]
    middle = {"q4_1": [("m", 2, 4)], "q5_0": [("qh", 2, 6)]}.get(base, [])
    return [("d", 0, 2), *middle, ("nibbles", size - 16, size)]


def pack_rows(blocks: np.ndarray, block_type: str) -> np.ndarray:
    """uint8 [N, row bytes] rows of `block_type` (q4_0, q4_1 or q5_0; N a multiple of 8) ->
    the same bytes as 8-row tiles, [N, row bytes]."""
    size = BLOCK_SIZES[block_type][1]
    n, row_bytes = blocks.shape
    if n % TILE_ROWS or row_bytes % size:
        raise ValueError(f"{block_type} rows [{n}, {row_bytes}] do not make tiles of "
                         f"{TILE_ROWS} rows of whole blocks")
    tiles, nb = n // TILE_ROWS, row_bytes // size
    # [tile, block, row, block bytes]
    b = np.ascontiguousarray(blocks).reshape(tiles, TILE_ROWS, nb, size).transpose(0, 2, 1, 3)
    out = []
    for field, start, end in _fields(block_type):
        part = b[..., start:end]
        if field == "nibbles":  # [.., row, chunk, 4] -> [.., chunk, row, 4]
            part = part.reshape(tiles, nb, TILE_ROWS, 4, 4).transpose(0, 1, 3, 2, 4)
        elif field == "qh":  # row r's bits 4v..4v+3 -> vector v's bits 4r..4r+3
            high = np.ascontiguousarray(part).view("<u4")[..., 0]          # [tile, block, row]
            shifts = (4 * np.arange(TILE_ROWS, dtype=np.uint32))
            nibble = (high[..., :, None] >> shifts[None, :]) & 0xF        # [.., row, vector]
            part = np.bitwise_or.reduce(nibble << shifts[:, None], axis=-2)  # [.., vector]
            part = part.astype("<u4").view(np.uint8)
        out.append(np.ascontiguousarray(part).reshape(tiles, nb, -1))
    return np.concatenate(out, axis=-1).reshape(n, row_bytes)


def unpack_rows(blocks, packed_type: str) -> tf.Tensor:
    """Pure TF: uint8 [N, row bytes] tiles of `packed_type` -> the file's rows of its type."""
    base = PACKED[packed_type]
    size = BLOCK_SIZES[base][1]
    blocks = tf.convert_to_tensor(blocks, tf.uint8)
    n, row_bytes = tf.shape(blocks)[0], tf.shape(blocks)[1]
    tiles, nb = n // TILE_ROWS, row_bytes // size
    b = tf.reshape(blocks, [tiles, nb, TILE_ROWS * size])
    fields, at = [], 0
    for field, start, end in _fields(base):
        width = TILE_ROWS * (end - start)
        part = b[..., at:at + width]
        at += width
        if field == "nibbles":  # [.., chunk, row, 4] -> [.., row, 16]
            part = tf.reshape(tf.transpose(tf.reshape(part, [tiles, nb, 4, TILE_ROWS, 4]),
                                           [0, 1, 3, 2, 4]), [tiles, nb, TILE_ROWS, 16])
        elif field == "qh":  # vector v's bits 4r..4r+3 -> row r's bits 4v..4v+3
            # int32: TF has no uint32 shift kernel; the 0xF mask drops the sign's extension
            vectors = tf.bitcast(tf.reshape(part, [tiles, nb, TILE_ROWS, 4]), tf.int32)
            shifts = 4 * tf.range(TILE_ROWS, dtype=tf.int32)
            nibble = tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(vectors[..., None, :], shifts[:, None]), 0xF)  # [r, v]
            high = tf.reduce_sum(tf.bitwise.left_shift(nibble, shifts[None, :]), axis=-1)
            part = tf.bitcast(high, tf.uint8)                               # [.., row, 4]
        else:
            part = tf.reshape(part, [tiles, nb, TILE_ROWS, end - start])
        fields.append(part)
    rows = tf.transpose(tf.concat(fields, axis=-1), [0, 2, 1, 3])  # [tile, row, block, bytes]
    return tf.reshape(rows, [n, row_bytes])
