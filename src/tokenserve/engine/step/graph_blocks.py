"""The dense half of every block as TF ops (XLA-compiled for float32 weights).

The dense half (norms, projections, MLP) and the LM head are functions of explicit weights,
so one XLA program per token bucket serves every layer. XLA's float32 dot code beats
oneDNN's at every batch size on these CPUs, while oneDNN's bf16 matmuls beat XLA's: bfloat16
weights run the same functions in graph mode. The KV cache never enters them: XLA would copy
the cache variables in and out on every call.

A step is enter (the first block's QKV), between (a block's second half and the next
block's QKV) once per layer boundary, exit (the last block's second half), then the head on
one row per sequence. fused_blocks.py has the same four as the fused ops.
"""

from __future__ import annotations

import tensorflow as tf

from tokenserve.engine.step.moe import graph_moe
from tokenserve.model.layers import apply_rope, head_norm, linear, mlp, norm
from tokenserve.model.transformer import TransformerLM


class GraphBlocks:
    """enter, between, exit and head of a TransformerLM as TF ops; with `jit`, each an XLA
    function traced once (one program per token bucket, shared by every layer).

    weights: the blocks' weights by role (block_weights), one dict per layer."""

    def __init__(self, model: TransformerLM, weights: list[dict], kv_width: int, jit: bool):
        self.model, self.weights, self.kv_width = model, weights, kv_width
        dense = ((lambda fn: tf.function(fn, jit_compile=True, autograph=False)) if jit
                 else (lambda fn: fn))
        self.enter, self.between, self.exit = (dense(self._qkv), dense(self._between),
                                               dense(self._exit))
        self.head = dense(model.head_logits)  # on one row per sequence: its own bucket

    def _qkv(self, x, rotary, w):
        """x: [N, D] -> q [N, H, Dh], k, v [N, Hkv*Dh] (QK-norm and RoPE applied)."""
        c = self.model.config
        qkv = linear(norm(x, w["attn_norm"], c.norm, c.norm_eps), w["qkv"])
        return self._split_qkv(qkv, rotary, w)

    def _split_qkv(self, qkv, rotary, w=None):
        c = self.model.config
        # static shapes with -1 for the tokens: no Shape/StridedSlice/Pack ops per layer
        q, k, v = tf.split(qkv, [c.num_heads * c.head_dim, self.kv_width, self.kv_width], -1)
        q = tf.reshape(q, [-1, c.num_heads, c.head_dim])
        if w is not None and "q_norm" in w:  # QK-norm (head_norm), before RoPE
            q = head_norm(q, w["q_norm"], c.norm_eps)
            k = tf.reshape(head_norm(tf.reshape(k, [-1, c.num_kv_heads, c.head_dim]),
                                     w["k_norm"], c.norm_eps), [-1, self.kv_width])
        if rotary is not None:
            q = apply_rope(q[None], *rotary)[0]
            k = tf.reshape(apply_rope(tf.reshape(k, [1, -1, c.num_kv_heads, c.head_dim]),
                                      *rotary), [-1, self.kv_width])
        return q, k, v

    def _finish_block(self, x, attn, w):
        c = self.model.config
        h = linear(attn, w["out"])
        x = x + (norm(h, w["post_attn_norm"], c.norm, c.norm_eps) if "post_attn_norm" in w
                 else h)
        h = norm(x, w["mlp_norm"], c.norm, c.norm_eps)
        if "moe" in w:  # a mixture of experts, grouped by expert (never under XLA)
            h = graph_moe(h, w["moe"], c)
        else:
            h = mlp(h, w["up"], w["down"], c.mlp)
        return x + (norm(h, w["post_mlp_norm"], c.norm, c.norm_eps) if "post_mlp_norm" in w
                    else h)

    def _between(self, x, attn, rotary, w, w_next):
        x = self._finish_block(x, attn, w)
        return (x, *self._qkv(x, rotary, w_next))

    def _exit(self, x, attn, w):
        return self._finish_block(x, attn, w)

    def final_norm(self, x):
        """The head's norm alone (the screened head's input), on the model's variables."""
        m = self.model
        c = m.config
        return norm(x, m.final_norm.weights_dict(), c.norm, c.norm_eps)
