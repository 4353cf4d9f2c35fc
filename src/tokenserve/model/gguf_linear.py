"""Linear layers and embeddings on GGUF blocks as the file stores them (kernels/gguf_matmul).

A layer's weights dict (Dense.weights_dict, what the engine's dense functions take) holds its
blocks under keys that carry the block type, so the dict stays a plain structure of tensors
that tf.nest can map: "blocks:q4_1" for a layer of one type, "blocks0:q4_k", "blocks1:q6_k",
... for rows of several types, in row order (tf.nest sorts keys; one digit keeps that order).
"""

from __future__ import annotations

import tensorflow as tf

from tokenserve.kernels.gguf_types import BLOCK_SIZES
from tokenserve.kernels.gguf_matmul import dequantize_blocks, gguf_matmul, gguf_matmul_fallback

_PREFIX = "blocks"


def blocks_entries(block_types: list[str], blocks: list) -> dict:
    """The weights-dict entries of a layer whose rows are `blocks` (uint8 [rows, row bytes]
    each) of `block_types`, in row order."""
    if len(blocks) == 1:
        return {f"{_PREFIX}:{block_types[0]}": blocks[0]}
    if len(blocks) > 10:
        raise ValueError(f"a layer of {len(blocks)} block parts; at most 10 keep their order")
    return {f"{_PREFIX}{i}:{name}": b for i, (name, b) in enumerate(zip(block_types, blocks))}


def gguf_parts(weights: dict) -> list[tuple[str, object]]:
    """[(block type, blocks), ...] in row order from a weights dict; [] for other weights."""
    keys = sorted(k for k in weights if k.startswith(_PREFIX))
    return [(k.split(":", 1)[1], weights[k]) for k in keys]


def gguf_linear(x, parts, portable: bool = False):
    """x [..., K] @ the rows of `parts` (gguf_parts) .T -> [..., rows] in x's dtype.

    portable: stock TensorFlow ops only (the blocks dequantized each call), for graphs that a
    SavedModel carries to TF Serving; else the compiled op where it is built."""
    width = sum(int(b.shape[0]) for _, b in parts)
    flat = x.shape.rank == 2  # a step's rows already: no reshapes (each an op a call)
    rows = x if flat else tf.reshape(x, [-1, tf.shape(x)[-1]])
    if rows.dtype != tf.float32:
        rows = tf.cast(rows, tf.float32)
    if portable:
        ys = [gguf_matmul_fallback(rows, blocks, name) for name, blocks in parts]
    else:
        ys = [gguf_matmul(rows, blocks, name) for name, blocks in parts]
    y = ys[0] if len(ys) == 1 else tf.concat(ys, axis=-1)
    if y.dtype != x.dtype:
        y = tf.cast(y, x.dtype)
    return y if flat else tf.reshape(y, tf.concat([tf.shape(x)[:-1], [width]], 0))


def gguf_embedding(blocks, block_type: str, token_ids):
    """The rows `token_ids` [...] of a GGUF token embedding (uint8 [vocab, row bytes]),
    dequantized: float32 [..., D]. Only the looked-up rows are read."""
    values_per_block, nbytes = BLOCK_SIZES[block_type]
    width = int(blocks.shape[1]) // nbytes * values_per_block                     # D
    picked = tf.gather(blocks, tf.reshape(token_ids, [-1]))                # [n, row bytes]
    values = tf.reshape(dequantize_blocks(picked, block_type), [-1, width])  # [n, D]
    return tf.reshape(values, tf.concat([tf.shape(token_ids), [width]], 0))
