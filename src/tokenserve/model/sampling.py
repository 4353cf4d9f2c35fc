"""In-graph token sampling for the exported `generate` signature.

Everything is XLA-friendly: the full-vocabulary sort has a static size, the
top-k cut is a comparison against a dynamic k, and randomness is stateless,
keyed by (seed, step), so a seed reproduces a generation exactly.
"""

from __future__ import annotations

import tensorflow as tf


def _filtered_sample(logits, top_k, top_p, seed_pair):
    """Samples from `logits` after top-k and nucleus (top-p) cuts. logits: [B, V]."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_ids = tf.math.top_k(logits, k=vocab)  # [B, V], descending
    ranks = tf.range(vocab)[None, :]
    keep = tf.logical_or(top_k <= 0, ranks < top_k)
    probs = tf.nn.softmax(sorted_logits, axis=-1)
    mass_before = tf.cumsum(probs, axis=-1, exclusive=True)
    keep = tf.logical_and(keep, tf.logical_or(mass_before < top_p, ranks == 0))
    masked = tf.where(keep, sorted_logits, tf.float32.min)
    choice = tf.random.stateless_categorical(masked, 1, seed=seed_pair, dtype=tf.int32)[:, 0]
    return tf.gather(sorted_ids, choice, batch_dims=1)


def sample(logits, temperature, top_k, top_p, seed, step):
    """Picks one token per row.

    Args:
        logits: float32 [B, V].
        temperature: float32 scalar; <= 0 means greedy (argmax).
        top_k: int32 scalar; <= 0 disables the cut.
        top_p: float32 scalar; >= 1 disables the cut.
        seed, step: int32 scalars; the draw at a step depends only on both.

    Returns:
        int32 [B].
    """
    def greedy():
        return tf.argmax(logits, axis=-1, output_type=tf.int32)

    def sampled():
        scaled = logits / tf.maximum(temperature, 1e-6)
        seed_pair = tf.stack([seed, step])
        needs_sort = tf.logical_or(top_k > 0, top_p < 1.0)
        return tf.cond(
            needs_sort,
            lambda: _filtered_sample(scaled, top_k, top_p, seed_pair),
            lambda: tf.random.stateless_categorical(scaled, 1, seed=seed_pair,
                                                    dtype=tf.int32)[:, 0])

    return tf.cond(temperature > 0.0, sampled, greedy)
