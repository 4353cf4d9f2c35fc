"""Each packed token's sequence end: the furthest position its sequence reaches in the step.

LongRoPE (Phi-3) turns a token by its long factors where its sequence reaches past the
original context in the call that computes it (transformers' rule, model/rotary.py). The
step packs many sequences into one axis, so the rule is applied per sequence, not per step
(vLLM applies it per batch: one long prompt there switches its neighbours too).
"""

from __future__ import annotations

import tensorflow as tf


def sequence_ends(positions, decode_groups, prefill):
    """positions [N] (packed: decode tokens group by group, then prefill tokens, then
    padding) -> [N] int32: a decode token's own position (one token a sequence), a prefill
    token's sequence's last position in the step (from the prefill inputs' position table),
    padding's own position."""
    if not prefill:
        return positions
    index, _, prefill_positions, unpack = prefill        # index, positions: [Sp, Tp]
    num_decode = sum(tf.shape(group_positions)[0] for _, group_positions in decode_groups)
    num_prefill = tf.shape(unpack)[0]
    ends = tf.reduce_max(prefill_positions, axis=1, keepdims=True)             # [Sp, 1]
    # index's padding (Np) lands in one extra slot, dropped
    per_token = tf.scatter_nd(index[..., None], tf.broadcast_to(ends, tf.shape(index)),
                              [num_prefill + 1])[:num_prefill]                 # [Np]
    return tf.concat([positions[:num_decode], per_token,
                      positions[num_decode + num_prefill:]], 0)
