"""Random weights for the finish-block ops' tests (a transformer block's second half): the
float32 op's and its LoRA twin's."""

from __future__ import annotations

import numpy as np


def block_weights(d: int, f: int, activation: str, norm_bias: bool, seed: int):
    """(out [d, d], norm, up [d, f], down [f or f / 2 for a gated activation, d]) in float32,
    as kernels.dense.finish_block takes them: dicts of "kernel" and, with norm_bias, "bias"
    (norm: "scale", and "bias" with norm_bias: LayerNorm, else RMSNorm)."""
    import tensorflow as tf

    from tokenserve.kernels.dense import GATED

    rng = np.random.default_rng(seed)

    def dense(k, n, bias):
        w = {"kernel": tf.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))}
        if bias:
            w["bias"] = tf.constant(rng.standard_normal(n).astype(np.float32) * 0.1)
        return w

    norm = {"scale": tf.constant(1 + 0.1 * rng.standard_normal(d).astype(np.float32))}
    if norm_bias:
        norm["bias"] = tf.constant(0.1 * rng.standard_normal(d).astype(np.float32))
    inner = f // 2 if activation in GATED else f
    return dense(d, d, norm_bias), norm, dense(d, f, norm_bias), dense(inner, d, norm_bias)
