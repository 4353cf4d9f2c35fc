"""Rotary position embedding in TensorFlow: each layer's cos and sin for a step's positions
(its base, its frequency scaling, LongRoPE's choice between short and long factors) and
their application to q and k. The frequencies themselves are rope.py's (NumPy)."""

from __future__ import annotations

import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.model.rope import rope_inverse_frequencies


def rope_angles(positions, head_dim: int, theta: float, dtype,
                freq_factors: tuple[float, ...] = (), attention_factor: float = 1.0):
    """RoPE (Hugging Face's rotate-half convention), first half: cos and sin of the angles,
    [B, T, 1, Dh] each for int32 positions [B, T], shared by q, k and every layer of one base
    (apply_rope applies them). head_dim: the rotated width (a partial rotary's rotary_dim, then
    also cos' and sin's last axis); attention_factor scales both (YaRN)."""
    if not freq_factors:  # the graph every export without scaling has always had
        inv_freq = 1.0 / (theta ** (tf.range(0, head_dim, 2, dtype=tf.float32) / head_dim))
    else:
        # rounded to float32 once, from float64: within an ulp of transformers' float32
        inv_freq = tf.constant(rope_inverse_frequencies(head_dim, theta, freq_factors),
                               tf.float32)
    angles = tf.cast(positions, tf.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = tf.concat([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    cos, sin = tf.cos(angles), tf.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return tf.cast(cos, dtype), tf.cast(sin, dtype)


def layer_rope_angles(config: TransformerConfig, layer: int, positions, dtype,
                      sequence_ends=None):
    """rope_angles for layer `layer` of `config` (its base, scaling and rotated width).

    Under LongRoPE (Phi-3) a token turns by the long factors where its sequence reaches past
    the original context in this call, as transformers decides per call: sequence_ends
    (positions' shape, or [B, 1]) holds each token's sequence's furthest position; by default
    each row's last. A sequence that crosses the original context while it decodes keeps the
    keys it cached before with the short factors, as transformers' model called on its cache
    and vLLM do (Phi-3's `generate` in transformers recomputes its cache there instead)."""
    theta, factors, attention_factor = config.layer_rope(layer)
    angles = rope_angles(positions, config.rotary_dim, theta, dtype, factors, attention_factor)
    if not config.rope_long_freq_factors or factors != config.rope_freq_factors:
        return angles  # no LongRoPE, or a local layer of its own base
    long = rope_angles(positions, config.rotary_dim, theta, dtype,
                       config.rope_long_freq_factors, attention_factor)
    if sequence_ends is None:
        sequence_ends = tf.reduce_max(positions, axis=-1, keepdims=True)
    use_long = (sequence_ends >= config.rope_original_context)[..., None, None]
    return tuple(tf.where(use_long, b, a) for a, b in zip(angles, long))


def apply_rope(x, cos, sin):
    """x: [B, T, H, Dh] rotated by the angles of rope_angles (second half); with cos and sin
    narrower than Dh (a partial rotary), only the leading dimensions turn."""
    rotary, width = cos.shape[-1], x.shape[-1]
    if rotary is not None and width is not None and rotary < width:
        turned, passed = tf.split(x, [rotary, width - rotary], axis=-1)
        return tf.concat([apply_rope(turned, cos, sin), passed], axis=-1)
    x1, x2 = tf.split(x, 2, axis=-1)
    return x * cos + tf.concat([-x2, x1], axis=-1) * sin
