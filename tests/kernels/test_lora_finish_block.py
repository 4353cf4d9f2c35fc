"""The fused block op with per-row LoRA deltas (kernels/lora_finish_block.cc) against the
plain fused ops plus each delta written out in TF: rows of different adapters and of the
base, both activations, with and without the next block's QKV, and bad factor shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import dense as kd


def _block_weights(d, f, activation, norm_bias, seed):
    """A block's second half in float32: out [d, d], norm, up [d, f], down [f or f/2, d]."""
    rng = np.random.default_rng(seed)

    def dense(k, n, bias):
        w = {"kernel": tf.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))}
        if bias:
            w["bias"] = tf.constant(rng.standard_normal(n).astype(np.float32) * 0.1)
        return w

    norm = {"scale": tf.constant(1 + 0.1 * rng.standard_normal(d).astype(np.float32))}
    if norm_bias:
        norm["bias"] = tf.constant(0.1 * rng.standard_normal(d).astype(np.float32))
    inner = f // 2 if activation == "swiglu" else f
    return dense(d, d, norm_bias), norm, dense(d, f, norm_bias), dense(inner, d, norm_bias)


@pytest.fixture(scope="module")
def compiled():
    return compiled_op_module(kd.LIBRARY)


def _factors(rng, k, rank, width_in, width_out):
    a = rng.standard_normal((width_in, k * rank)) / np.sqrt(width_in)
    b = rng.standard_normal((k * rank, width_out)) * 0.3
    a, b = a.astype(np.float32), b.astype(np.float32)
    return tf.constant(a), tf.constant(b)


def _delta(x, factors, one_hot):
    a, b = factors
    mask = tf.repeat(one_hot, a.shape[1] // one_hot.shape[1], axis=1)
    return tf.matmul(tf.matmul(x, a) * mask, b)


@pytest.mark.parametrize("activation,norm_bias,m,d,f,k", [
    ("gelu_tanh", True, 5, 64, 256, 3),   # GPT-2: LayerNorm, biases; 3 adapters and the base
    ("swiglu", False, 1, 40, 344, 1),     # one row on one adapter
    ("swiglu", False, 12, 72, 200, 2)])   # packed chunks from 9 rows
def test_lora_finish_block_equals_the_separate_ops(compiled, activation, norm_bias, m, d, f,
                                                   k):
    out, norm, up, down = _block_weights(d, f, activation, norm_bias, seed=m + d)
    _, next_norm, next_qkv, _ = _block_weights(d, 3 * d, activation, norm_bias, seed=7)
    rng = np.random.default_rng(2)
    attn = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32) * 3)
    slots = rng.integers(-1, k, size=m)  # -1: a row of the base model
    one_hot = tf.one_hot(slots, k, dtype=tf.float32)
    inner = f // 2 if activation == "swiglu" else f
    factors = {"out": _factors(rng, k, 4, d, d), "up": _factors(rng, k, 8, d, f),
               "down": _factors(rng, k, 4, inner, d), "qkv": _factors(rng, k, 12, d, 3 * d)}
    y, following = kd.lora_finish_block(attn, x, out, norm, up, down, one_hot, factors,
                                        activation, 1e-5, next_norm=next_norm,
                                        next_qkv=next_qkv)
    alone = kd.lora_finish_block(attn, x, out, norm, up, down, one_hot, factors, activation,
                                 1e-5)

    x1 = kd.dense(attn, out["kernel"], out.get("bias"), x) + _delta(attn, factors["out"],
                                                                     one_hot)
    h = kd.layer_norm(x1, norm["scale"], norm.get("bias"), 1e-5)
    z = kd.dense(h, up["kernel"], up.get("bias")) + _delta(h, factors["up"], one_hot)
    u = kd.epilogue(z, activation=activation)
    expected = kd.dense(u, down["kernel"], down.get("bias"), x1) + _delta(u, factors["down"],
                                                                          one_hot)
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(alone.numpy(), y.numpy(), rtol=1e-5, atol=1e-5)
    h = kd.layer_norm(expected, next_norm["scale"], next_norm.get("bias"), 1e-5)
    expected_next = kd.dense(h, next_qkv["kernel"], next_qkv.get("bias")) + _delta(
        h, factors["qkv"], one_hot)
    np.testing.assert_allclose(following.numpy(), expected_next.numpy(), rtol=1e-4, atol=1e-4)
    # the base model's rows are the plain fused op's
    base = [i for i in range(m) if slots[i] == -1]
    if base:
        plain = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-5).numpy()
        np.testing.assert_allclose(y.numpy()[base], plain[base], rtol=1e-5, atol=1e-5)


def test_lora_finish_block_refuses_factors_that_do_not_fit(compiled):
    out, norm, up, down = _block_weights(64, 256, "gelu_tanh", True, seed=0)
    rng = np.random.default_rng(0)
    attn = x = tf.zeros([2, 64])
    one_hot = tf.one_hot([0, 1], 2)
    factors = {"out": _factors(rng, 2, 4, 64, 64), "up": _factors(rng, 2, 4, 64, 256),
               "down": _factors(rng, 2, 4, 256, 64)}
    bad = dict(factors, up=_factors(rng, 2, 4, 63, 256))
    with pytest.raises(tf.errors.InvalidArgumentError, match="LoRA factors of input 6"):
        kd.lora_finish_block(attn, x, out, norm, up, down, one_hot, bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one_hot must be"):
        kd.lora_finish_block(attn, x, out, norm, up, down, tf.zeros([3, 2]), factors)
