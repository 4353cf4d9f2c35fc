"""A float32 LM head that reads a float16 copy of its weights for greedy steps, with exact
tokens (design notes: docs/engine.md, "The screened LM head").

One float32 decode stream is bound by memory reads, and a tied GPT-2-small head is 154 MB
of the 494 MB a step reads. A greedy step needs only the argmax of each row, so the head
runs on a float16 copy (half the bytes; x and the sums stay float32) and bounds, for every
vocabulary entry i, how far that can be from the float32 logit:

    |w_i . x - h_i . x|  =  |(w_i - h_i) . x|  <=  r_i ||x||      (Cauchy-Schwarz)

with h_i the float16 row and r_i = ||w_i - h_i|| (fixed at load), plus the float32 rounding
of both dot products. Every entry whose upper bound reaches the best lower bound is a
candidate; no other can be the argmax. The candidates' logits are computed again from the
float32 rows (a few rows of the matrix) and written over the approximations, so the argmax
of what the step returns is the float32 argmax. Non-candidates keep their approximate
values, so a step through this head serves greedy rows only: the runner takes it when no
row needs a distribution (sampling, penalties, logprobs, structured output).

Why float16 and not int8: the int8 kernel also quantizes x per block of 32 values, and a
model whose final-norm output has a few large channels (SmolLM2) then gets an error bound
of several logits, and thousands of candidates a row on random prompts (0.92x of the plain
head at four sequences); float16 rows leave x exact and the bound near 1e-3 logits.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.kernels.half_matmul import half_matmul

# Float32 rounding of a dot product of length K: at most ~K * 2^-24 of sum |x_j w_j|, which
# is <= ||x|| ||w||; the screen computes two (the float16 one and the exact one), and the
# float32 head it stands in for a third.
_ROUNDING_PER_TERM = 4 * 2.0 ** -24
# Rows whose norms are taken in float64 at once: 4,096 rows of 768 are 25 MB a copy, where
# the whole of GPT-2's head at once would be 309 MB (x2) more at load.
_NORM_CHUNK_ROWS = 4096


class ScreenedHead:
    """Greedy-exact logits [S, vocab] from a float16 screen of a float32 head.

    weight: the float32 head as the step reads it, [vocab, D] (a tied token embedding,
    layout "nk") or [D, vocab] (a Dense kernel, "kn"); bias: [vocab] or None."""

    def __init__(self, weight, layout: str, bias=None):
        if layout not in ("nk", "kn"):
            raise ValueError(f"layout must be 'nk' or 'kn', got {layout!r}")
        # an eager read aliases a variable's buffer (no copy): the step captures a tensor
        self.weight = tf.convert_to_tensor(weight)
        self.layout, self.bias = layout, bias
        rows = self.weight.numpy()
        rows = rows if layout == "nk" else rows.T                     # [vocab, D]
        # float16 saturates at 65504: a larger weight stays exact in the bound (r_i grows)
        halves = np.clip(rows, -65504, 65504).astype(np.float16)
        self.halves = tf.constant(np.ascontiguousarray(halves))
        bound = np.empty(rows.shape[0], np.float64)
        for start in range(0, rows.shape[0], _NORM_CHUNK_ROWS):  # float64 copies of a chunk
            part = slice(start, start + _NORM_CHUNK_ROWS)
            widened = halves[part].astype(np.float64)
            residual = np.linalg.norm(rows[part].astype(np.float64) - widened, axis=1)
            rounding = _ROUNDING_PER_TERM * rows.shape[1] * np.linalg.norm(widened, axis=1)
            bound[part] = residual + rounding
        # a hair over: float32 storage of the per-row constant must not round it down
        self.row_bound = tf.constant((bound * 1.0001).astype(np.float32))
        self.nbytes = self.bytes_for(self.weight.shape, layout)

    @staticmethod
    def bytes_for(shape, layout: str) -> int:
        """The memory a screen of a head of this shape and layout holds beside it: the
        float16 rows and one float32 bound per vocabulary entry."""
        vocab = shape[0] if layout == "nk" else shape[1]
        return 2 * int(shape[0]) * int(shape[1]) + 4 * int(vocab)

    def bounds(self, x):
        """x [S, D] float32 -> (approximate logits [S, vocab] with the bias, their error
        bounds)."""
        approx = half_matmul(x, self.halves)
        if self.bias is not None:  # before the screen: the bias moves the argmax
            approx = approx + self.bias
        return approx, tf.norm(x, axis=-1, keepdims=True) * self.row_bound

    def __call__(self, x):
        """x [S, D] float32 (normed) -> [S, vocab] float32: the float32 logits of every
        entry that could be a row's argmax, the float16 approximation elsewhere."""
        approx, bound = self.bounds(x)
        floor = tf.reduce_max(approx - bound, axis=-1, keepdims=True)        # [S, 1]
        candidates = tf.where(approx + bound >= floor)                      # [C, 2]
        rows, entries = candidates[:, 0], candidates[:, 1]
        if self.layout == "nk":
            weights = tf.gather(self.weight, entries)                       # [C, D]
        else:
            weights = tf.transpose(tf.gather(self.weight, entries, axis=1))
        exact = tf.reduce_sum(weights * tf.gather(x, rows), axis=-1)        # [C]
        if self.bias is not None:
            exact = exact + tf.gather(self.bias, entries)
        return tf.tensor_scatter_nd_update(approx, candidates, exact)
