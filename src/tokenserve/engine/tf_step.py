"""The engine's compiled steps: one tf.function per model family, traced once.

Transformer: the KV cache is two resource variables per layer (keys, values), each
[rows, Hkv * Dh] with rows = num_blocks * block_size. A step scatters only the new tokens' keys/values into it
and gathers only the rows of the live context (ResourceScatterUpdate / ResourceGather).
Nothing ever reads the variable densely: after a sparse update TF keeps a variable in
copy-on-read mode, and one dense read would copy the whole cache (DESIGN.md measured
0.2-2.8 s per step for that). No XLA either: an XLA cluster copies resource variables in
and out, and oneDNN's bf16 matmuls beat XLA's on these CPUs (DESIGN.md). So per-step
memory traffic is the weights plus the live context, independent of cache capacity
(benchmarks/kv_capacity.py). Dims are None in the signatures: graph mode runs any shape
without retracing; the runner still pads to a few sizes so oneDNN reuses its primitives.

Tokens of all sequences are packed into one [N] axis for the dense layers (no padding);
attention runs for decode rows (one query each), in up to `num_decode_groups` groups of
similar context length so short contexts are not padded to the longest, and for prefill rows
(a chunk each).
Decode attention is memory-bound (it reads every live key and value once per step), so it
is written to read the gathered rows in their stored layout with no transposes: the query
becomes a block-diagonal [Hkv*Dh, H] matrix, and two batched matmuls give scores [S, L, H]
and outputs. This halved the per-layer attention time against einsum-based attention at
32 sequences x 448 positions (19.2 -> 10.9 ms in bf16).
"""

from __future__ import annotations

import math

import tensorflow as tf

from tokenserve.model.layers import attend, rope
from tokenserve.model.lstm import LSTMLM
from tokenserve.model.transformer import TransformerLM

I32 = tf.int32


def _spec(shape, dtype=I32):
    return tf.TensorSpec(shape, dtype)


class TransformerStep(tf.Module):
    """Paged-attention step for a TransformerLM over a block-pooled KV cache."""

    def __init__(self, model: TransformerLM, num_rows: int, num_decode_groups: int = 6):
        super().__init__(name="transformer_step")
        self.model = model
        c = model.config
        self.kv_width = c.num_kv_heads * c.head_dim
        self.caches = [tuple(tf.Variable(tf.zeros([num_rows, self.kv_width], model.compute_dtype),
                                         trainable=False, name=f"{kind}_cache_{i}")
                             for kind in ("key", "value"))
                       for i in range(c.num_layers)]
        group = c.num_heads // c.num_kv_heads
        # head h reads kv head h // group: [H, Hkv]
        self.head_to_kv = tf.one_hot(tf.range(c.num_heads) // group, c.num_kv_heads,
                                     dtype=model.compute_dtype)
        self.step = tf.function(self._step, input_signature=[
            _spec([None]),          # token_ids      [N]
            _spec([None]),          # positions      [N]
            _spec([None]),          # write_rows     [N]   cache row of each new token
            # decode groups, by context length, so short contexts are not padded to long ones
            [(_spec([None]),        # tokens [Sg]  packed index of each decode query
              _spec([None, None]),  # rows   [Sg, Lg] context rows (padding: row 0)
              _spec([None]))        # pos    [Sg]  query position
             ] * num_decode_groups,
            _spec([None, None]),    # prefill_tokens [Sp, Tp] packed index (padding: N)
            _spec([None, None]),    # prefill_rows   [Sp, Lp]
            _spec([None, None]),    # prefill_pos    [Sp, Tp] query positions (padding: -1)
            _spec([None]),          # last_tokens    [S]   packed index whose logits we need
        ])

    def _gather_kv(self, rows, cache):
        keys, values = cache
        return tf.gather(keys, rows), tf.gather(values, rows)             # [S, L, Hkv*Dh] x2

    def _decode_attention(self, q, rows, query_pos, cache):
        """q: [S, H, Dh]; rows: [S, L]; query_pos: [S] -> [S, H*Dh]."""
        c = self.model.config
        keys, values = self._gather_kv(rows, cache)
        num_seqs = tf.shape(q)[0]
        # block-diagonal queries: column h holds q[h] in the rows of its kv head
        q_blocks = tf.einsum("shd,hg->sgdh", q * (1.0 / math.sqrt(c.head_dim)), self.head_to_kv)
        q_blocks = tf.reshape(q_blocks, [num_seqs, self.kv_width, c.num_heads])
        scores = tf.cast(tf.matmul(keys, q_blocks), tf.float32)           # [S, L, H]
        mask = tf.range(tf.shape(rows)[1])[None, :] <= query_pos[:, None]  # [S, L]
        scores = tf.where(mask[:, :, None], scores, tf.float32.min)
        probs = tf.cast(tf.nn.softmax(scores, axis=1), values.dtype)
        out = tf.matmul(probs, values, transpose_a=True)                   # [S, H, Hkv*Dh]
        out = tf.reshape(out, [num_seqs, c.num_heads, c.num_kv_heads, c.head_dim])
        out = tf.reduce_sum(out * self.head_to_kv[None, :, :, None], axis=2)  # own kv head
        return tf.reshape(out, [num_seqs, c.num_heads * c.head_dim])

    def _prefill_attention(self, q_padded, tokens, rows, query_pos, cache):
        """q_padded: [N + 1, H, Dh]; tokens, query_pos: [S, T]; rows: [S, L] -> [S, T, H*Dh]."""
        c = self.model.config
        q = tf.gather(q_padded, tokens)                                    # [S, T, H, Dh]
        keys, values = self._gather_kv(rows, cache)
        shape = tf.concat([tf.shape(rows), [c.num_kv_heads, c.head_dim]], 0)
        key_pos = tf.range(tf.shape(rows)[1])
        mask = key_pos[None, None, :] <= query_pos[:, :, None]             # [S, T, L]
        return attend(q, tf.reshape(keys, shape), tf.reshape(values, shape), mask)

    def _step(self, token_ids, positions, write_rows, decode_groups, prefill_tokens, prefill_rows,
              prefill_pos, last_tokens):
        m, c = self.model, self.model.config
        num_tokens = tf.shape(token_ids)[0]
        x = m._embed(token_ids, positions)                                 # [N, D]
        scatter_index = tf.concat([tokens for tokens, _, _ in decode_groups]
                                  + [tf.reshape(prefill_tokens, [-1])], 0)
        for block, cache in zip(m.blocks, self.caches):
            qkv = block.attn.qkv(block.attn_norm(x))                       # [N, (H+2Hkv)Dh]
            q, k, v = tf.split(qkv, [c.num_heads * c.head_dim, self.kv_width, self.kv_width], -1)
            q = tf.reshape(q, [num_tokens, c.num_heads, c.head_dim])
            if c.position == "rope":
                q = rope(q[None], positions[None], c.rope_theta)[0]
                k = tf.reshape(rope(tf.reshape(k, [1, num_tokens, c.num_kv_heads, c.head_dim]),
                                    positions[None], c.rope_theta), [num_tokens, self.kv_width])
            for variable, new_rows in zip(cache, (k, v)):
                variable.scatter_update(tf.IndexedSlices(tf.cast(new_rows, variable.dtype),
                                                         write_rows))
            q_padded = tf.concat([q, tf.zeros_like(q[:1])], 0)             # row N: padding
            decoded = [self._decode_attention(tf.gather(q_padded, tokens), rows, pos, cache)
                       for tokens, rows, pos in decode_groups]             # [Sg, HD] each
            prefilled = self._prefill_attention(q_padded, prefill_tokens, prefill_rows,
                                                prefill_pos, cache)        # [Sp, Tp, HD]
            width = c.num_heads * c.head_dim
            updates = tf.concat(decoded + [tf.reshape(prefilled, [-1, width])], 0)
            attn = tf.scatter_nd(scatter_index[:, None], updates, [num_tokens + 1, width])
            x = x + block.attn.out(attn[:num_tokens])
            x = x + block.mlp(block.mlp_norm(x))
        return m._logits(tf.gather(x, last_tokens))                        # [S, vocab] f32


class LSTMStep(tf.Module):
    """Slot step for an LSTMLM: each sequence's (h, c) lives in one row of a state pool."""

    def __init__(self, model: LSTMLM, num_slots: int):
        super().__init__(name="lstm_step")
        self.model = model
        c = model.config
        self.states = tf.Variable(tf.zeros([num_slots, c.num_layers, 2, c.hidden_size],
                                           tf.float32), trainable=False, name="lstm_states")
        self.step = tf.function(self._step, input_signature=[
            _spec([None, None]),    # token_ids  [S, T] right-padded
            _spec([None]),          # num_tokens [S]
            _spec([None]),          # slots      [S]
            _spec([None], tf.bool),  # fresh     [S] start from a zero state
        ])

    def _step(self, token_ids, num_tokens, slots, fresh):
        state = tf.gather(self.states, slots)                              # [S, layers, 2, H]
        state = tf.where(fresh[:, None, None, None], tf.zeros_like(state), state)
        state = tf.transpose(state, [1, 2, 0, 3])                          # [layers, 2, S, H]
        logits, state = self.model.step(token_ids, state, tf.zeros_like(num_tokens), num_tokens)
        self.states.scatter_update(tf.IndexedSlices(tf.transpose(state, [2, 0, 1, 3]), slots))
        return logits
