"""Attention over the paged KV cache, in graph mode (never XLA: an XLA cluster would copy the
cache variables in and out).

Attention runs per decode group (sequences of similar context length; one query each) and
for the prefill chunks. With the fused attention op (kernels/paged_attention.py), which
reads each sequence's own length, the runner makes one group of all decode rows, and each
prefill token is one more decode query over its own sequence's rows up to its position, so
a layer's prefill attention is one op too. The graph path, where the op cannot be built,
gathers the rows: decode attention reads them in their stored layout with no transposes
(each head's query spread over the kv-head columns, zero elsewhere; two batched matmuls
give scores [S, H, L] and outputs), prefill attention runs a masked attention per chunk.

A windowed layer (a sliding window of W positions) reads only its last W rows: with the op,
each query's row table is cut to the W rows before it (a gather of [S, W] row numbers, once
a step per window), so its cost stays flat as the context grows; the graph path masks.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tokenserve.kernels import paged_attention
from tokenserve.model.layers import attend, soft_cap, visible


class PagedPrefill(NamedTuple):
    """A step's prefill tokens as decode queries of the paged attention op: each token's
    context rows [Np, Lp] (its sequence's) and length [Np] (its position + 1)."""
    rows: tf.Tensor
    lengths: tf.Tensor


class PagedAttention:
    """A layer's attention over its (keys, values) cache variables, [rows, Hkv*Dh] each.

    fused: through the paged attention op (it reads K/V rows in place: no gathered copies,
    one op per layer); else the graph path, the same math on gathered rows."""

    def __init__(self, config, kv_width: int, compute_dtype, fused: bool):
        self.config, self.kv_width = config, kv_width
        self.compute_dtype, self.fused = compute_dtype, fused
        group = config.num_heads // config.num_kv_heads
        # head h reads kv head h // group: [H, Hkv], with the 1/sqrt(Dh) score scale folded in
        self.head_to_kv = tf.one_hot(tf.range(config.num_heads) // group, config.num_kv_heads,
                                     dtype=compute_dtype)
        self.scaled_head_to_kv = self.head_to_kv * config.score_scale

    def step_inputs(self, decode_groups, prefill, window: int = 0):
        """What every layer of window `window` (0: global) reads, built once a step: (the
        decode groups (rows [Sg, Lg], or [Sg, W] cut to the window (fused); pos [Sg]), per
        group its context lengths [Sg] (fused) or mask bias [Sg, 1, Lg], the number of
        prefill tokens, the prefill as the layers take it: a PagedPrefill (fused), (index,
        rows, mask [Sp, Tp, Lp], unpack) (graph path) or None)."""
        if self.fused:  # context lengths [Sg]
            biases = [pos + 1 for _, pos in decode_groups]
            if window:
                cut = [window_rows(rows, length, window)
                       for (rows, _), length in zip(decode_groups, biases)]
                decode_groups = [(rows, pos) for (rows, _), (_, pos) in zip(cut, decode_groups)]
                biases = [length for _, length in cut]
        else:
            biases = [tf.where(visible(tf.range(tf.shape(rows)[1])[None, None, :],
                                       pos[:, None, None], window),
                               0.0, tf.float32.min) for rows, pos in decode_groups]  # [Sg,1,Lg]
        num_prefill = tf.shape(prefill[3])[0] if prefill else tf.constant(0)
        if prefill and self.fused:
            # Prefill token j of a sequence attends to its sequence's rows up to its own
            # position: a decode query with that context. Each token's context rows and
            # length, built once per step, make every layer's prefill attention one op
            # reading the rows in place, where the gathered path below runs about 50 ops
            # per layer on widened copies: 1.4-3.8x faster per layer for chunks of 32 to 512
            # tokens (benchmarks/prefill_attention.py, GPT-2-small sizes, 2-core EPYC), and
            # the step traces in half the time.
            index, rows, pos, unpack = prefill
            sequence = unpack // tf.shape(index)[1]                          # [Np]
            prefill = PagedPrefill(rows=tf.gather(rows, sequence),           # [Np, Lp]
                                   lengths=tf.gather(tf.reshape(pos, [-1]), unpack) + 1)
            if window:
                prefill = PagedPrefill(*window_rows(prefill.rows, prefill.lengths, window))
        elif prefill:
            index, rows, pos, unpack = prefill
            mask = visible(tf.range(tf.shape(rows)[1])[None, None, :], pos[:, :, None],
                           window)                                            # [S, T, L]
            prefill = (index, rows, mask, unpack)
        else:
            prefill = None
        return decode_groups, biases, num_prefill, prefill

    def layout(self, decode_groups, num_prefill, num_tokens, dtype):
        """Where each part of the packed tokens goes, the same for every layer, so it is built
        once per step rather than once per layer (each op in the step costs several
        microseconds of executor time): q's split sizes (one per decode group, then the rest),
        the number of prefill tokens (0 without prefill) and the zero rows that stand for the
        bucket padding."""
        sizes = [tf.shape(rows)[0] for rows, _ in decode_groups]
        num_decode = tf.add_n(sizes) if sizes else tf.constant(0)
        split_sizes = tf.stack(sizes + [num_tokens - num_decode])
        c = self.config
        padding = tf.zeros([num_tokens - num_decode - num_prefill, c.num_heads * c.head_dim],
                           dtype)
        return split_sizes, num_prefill, padding

    def layer(self, q, decode_groups, biases, prefill, cache, layout, write=None):
        """q: [N, H, Dh] in packed order -> attention output [N, H*Dh]. write: the layer's
        new (keys, values, cache rows) for the fused op's first call to store (the graph
        orders the later calls, reads of the same variables, after it); None: stored
        already."""
        c = self.config
        width = c.num_heads * c.head_dim
        if write is not None and len(decode_groups) == 1 and prefill is None:
            # every query but the bucket padding is the group's, in order: the op attends
            # them and writes the padding's zeros itself (no split of q, no concat)
            (rows, _), = decode_groups
            return self.decode(q, rows, biases[0], cache, write)
        split_sizes, num_prefill, padding = layout
        pieces = tf.split(q, split_sizes, num=len(decode_groups) + 1)
        outputs = []
        for piece, (rows, _), bias in zip(pieces, decode_groups, biases):
            outputs.append(self.decode(piece, rows, bias, cache, write))
            write = None
        if isinstance(prefill, PagedPrefill):
            outputs.append(self.decode(pieces[-1][:num_prefill], prefill.rows,
                                       prefill.lengths, cache, write))
            write = None
        elif prefill is not None:
            index, rows, mask, unpack = prefill
            q_prefill = tf.concat([pieces[-1][:num_prefill], tf.zeros_like(q[:1])], 0)
            prefilled = self.prefill(q_prefill, index, rows, mask, cache)
            outputs.append(tf.gather(tf.reshape(prefilled, [-1, width]), unpack))
        if write is not None:  # the step passes rows only where a fused call takes them
            raise AssertionError("the layer's new K/V rows were not stored")
        outputs.append(padding)  # bucket padding
        return tf.concat(outputs, 0)

    def decode(self, q, rows, bias, cache, write=None):
        """q: [S, H, Dh]; rows: [S, L]; bias: [S, 1, L] (0 or -max) -> [S, H*Dh].

        With the fused op, `bias` is the lengths [S] of the contexts instead, and `write`
        (new keys, new values, their cache rows) or None: the layer's new rows, which the
        op stores before it attends; q may then have rows past S (padding: zeros out)."""
        c = self.config
        if self.fused:
            scale, cap = c.score_scale, c.attn_softcap
            if write is not None:
                return paged_attention.paged_write_decode_attention(
                    q, cache[0], cache[1], rows, bias, *write, scale, softcap=cap)
            return paged_attention.paged_decode_attention(q, cache[0], cache[1], rows, bias,
                                                          scale, softcap=cap)
        keys, values = self.gather_kv(rows, cache)
        num_seqs = tf.shape(q)[0]
        # each head's query spread over all kv-head columns, zero outside its own: one
        # batched matmul against the keys in their stored [L, Hkv*Dh] layout, no transposes
        # (an einsum here cost 0.1 ms a layer in op overhead at batch 1)
        q_rows = tf.reshape(q[:, :, None, :] * self.scaled_head_to_kv[None, :, :, None],
                            [num_seqs, c.num_heads, self.kv_width])
        scores = tf.matmul(q_rows, keys, transpose_b=True)                # [S, H, L]
        probs = tf.nn.softmax(soft_cap(tf.cast(scores, tf.float32), c.attn_softcap) + bias)
        out = tf.matmul(tf.cast(probs, values.dtype), values)              # [S, H, Hkv*Dh]
        if c.num_kv_heads > 1:  # keep each head's own kv head
            out = tf.reshape(out, [num_seqs, c.num_heads, c.num_kv_heads, c.head_dim])
            out = tf.reduce_sum(out * self.head_to_kv[None, :, :, None], axis=2)
        return tf.reshape(out, [num_seqs, c.num_heads * c.head_dim])

    def prefill(self, q, index, rows, mask, cache):
        """q: [Np + 1, H, Dh] (row Np: padding); index: [S, T]; rows: [S, L];
        mask: [S, T, L] -> [S, T, H*Dh]."""
        c = self.config
        keys, values = self.gather_kv(rows, cache)
        shape = tf.concat([tf.shape(rows), [c.num_kv_heads, c.head_dim]], 0)
        return attend(tf.gather(q, index), tf.reshape(keys, shape), tf.reshape(values, shape),
                      mask, c.score_scale, c.attn_softcap)

    def gather_kv(self, rows, cache):
        """rows [S, L] -> keys, values [S, L, Hkv*Dh] in the compute dtype (a 16-bit cache is
        widened after the gather: only the live rows, never the whole cache)."""
        return tuple(tf.cast(tf.gather(variable, rows), self.compute_dtype)
                     for variable in cache)


def window_rows(rows, lengths, window: int):
    """A row table cut to each query's last `window` positions: rows [S, L] and context
    lengths [S] -> rows [S, min(W, L)] (position max(0, length - W) first) and lengths
    min(length, W). Every row number stays one of the table's (valid for the op)."""
    width = tf.minimum(window, tf.shape(rows)[1])
    start = tf.maximum(lengths - window, 0)                              # [S]
    return (tf.gather(rows, start[:, None] + tf.range(width)[None, :], batch_dims=1),
            tf.minimum(lengths, window))
