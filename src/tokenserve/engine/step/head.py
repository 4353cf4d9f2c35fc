"""The LM head's screen: a float32 or bfloat16 head that reads an int8 (or float16) copy of
its weights for greedy steps, with exact tokens (design notes: docs/engine.md, "The
screened LM head"). The step runs it as a function of its own after the step's graph
(TransformerStep.head_function); the other heads are the blocks' (graph_blocks.py,
fused_blocks.py).

One float32 decode stream is bound by memory reads, and a tied GPT-2-small head is 154 MB
of the 494 MB a step reads. A greedy step needs only the argmax of each row, so the head
runs on a smaller copy h (int8 with one float32 scale per row, a quarter of the bytes; or
float16, half; x and the sums stay float32) and bounds, for every vocabulary entry i, how
far that can be from the float32 logit:

    |w_i . x - h_i . x|  =  |(w_i - h_i) . x|  <=  r_i ||x||      (Cauchy-Schwarz)

with h_i the row as the copy holds it (scale_i * q_i for int8) and r_i = ||w_i - h_i||
(fixed at load), plus the float32 rounding of both dot products. Every entry whose upper
bound reaches the best lower bound is a candidate; no other can be the argmax. The
candidates' logits are computed again from the float32 rows (a few rows of the matrix) and
written over the approximations, so the argmax of what the step returns is the float32
argmax. Non-candidates keep their approximate values, so a step through this head serves
greedy rows only: the runner takes it when no row needs a distribution (sampling,
penalties, logprobs, structured output).

The int8 copy's r_i is about 40x the float16 one's, so it leaves more candidates: on
GPT-2-small (random weights) a median of one a row and at most about 20, against at most
two; recomputing them reads a few KB, where the int8 copy saves 38 MB a token. Why not
the int8 weights op (kernels/int8_matmul): it also quantizes x per block of 32 values,
and a model whose final-norm output has a few large channels (SmolLM2) then gets an error
bound of several logits, and thousands of candidates a row on random prompts (0.92x of
the plain head at four sequences); these ops leave x exact. A row with a weight that is
not finite is a candidate on every step (its bound is infinite), so its float32 logit is
what the step returns.

A sampled row takes the same screen. Plain temperature sampling draws a token as the
argmax of logits + T * g, with g Gumbel noise per vocabulary entry (engine/sampler/draw.py), so
the noise is added to both bounds of every entry (it is exact: only the addition's rounding
widens them) and the candidates are those that could be that argmax; what the step returns
is logits + noise, exact for every candidate. A greedy row in the same step has zero noise.

A bfloat16 model's head is screened the same way: its fused dense op (kernels/dense.cc)
widens the bfloat16 weights exactly and computes in float32, so w_i above is the widened
row, and the candidates are recomputed from it.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tokenserve.engine.config import EngineConfig
from tokenserve.kernels import dense as kdense
from tokenserve.kernels import head_screen as screen_ops

log = logging.getLogger(__name__)

# Float32 rounding of a dot product of length K: at most ~K * 2^-24 of sum |x_j w_j|, which
# is <= ||x|| ||w||; the screen computes two (the float16 one and the exact one), and the
# float32 head it stands in for a third.
_ROUNDING_PER_TERM = 4 * 2.0 ** -24
# Rows whose norms are taken in float64 at once: 4,096 rows of 768 are 25 MB a copy, where
# the whole of GPT-2's head at once would be 309 MB (x2) more at load.
_NORM_CHUNK_ROWS = 4096
SCREEN_DTYPES = ("int8", "float16")


def _quantized(rows: np.ndarray, dtype: str):
    """(the copy the screen reads, its scale per row or None, that copy as float64) for a
    chunk of float32 rows [n, D]; a row with a weight that is not finite is all zeros."""
    finite = np.isfinite(rows).all(axis=1)
    rows = np.where(finite[:, None], rows, 0.0).astype(np.float32)
    if dtype == "float16":
        # float16 saturates at 65504: a larger weight stays exact in the bound (r_i grows)
        halves = np.clip(rows, -65504, 65504).astype(np.float16)
        return halves, None, halves.astype(np.float64)
    peak = np.abs(rows).max(axis=1)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale, q.astype(np.float64) * scale.astype(np.float64)[:, None]


class ScreenedHead:
    """Greedy-exact logits [S, vocab] from an int8 or float16 screen of a float32 (or
    bfloat16) head.

    weight: the head as the step reads it, float32 or bfloat16, [vocab, D] (a tied token
    embedding, layout "nk") or [D, vocab] (a Dense kernel, "kn"); bias: [vocab] or None;
    dtype: the screen's copy, "int8" (one scale per row) or "float16"."""

    def __init__(self, weight, layout: str, bias=None, dtype: str = "int8"):
        if layout not in ("nk", "kn"):
            raise ValueError(f"layout must be 'nk' or 'kn', got {layout!r}")
        if dtype not in SCREEN_DTYPES:
            raise ValueError(f"dtype must be one of {SCREEN_DTYPES}, got {dtype!r}")
        # an eager read aliases a variable's buffer (no copy): the step captures a tensor
        self.weight = tf.convert_to_tensor(weight)
        if self.weight.dtype not in (tf.float32, tf.bfloat16):
            raise ValueError(f"the head must be float32 or bfloat16, got {self.weight.dtype}")
        # a bfloat16 model's bias in float32, as the fused head adds it
        self.bias = None if bias is None else tf.cast(bias, tf.float32)
        self.layout, self.dtype = layout, dtype
        rows = self.weight.numpy()
        rows = rows if layout == "nk" else rows.T                     # [vocab, D]
        vocab, width = rows.shape
        copy = np.empty(rows.shape, np.int8 if dtype == "int8" else np.float16)
        scale = np.ones(vocab, np.float32)
        bound = np.empty(vocab, np.float64)
        for start in range(0, vocab, _NORM_CHUNK_ROWS):  # float64 copies of a chunk at a time
            part = slice(start, start + _NORM_CHUNK_ROWS)
            chunk = rows[part].astype(np.float32)  # bfloat16 widens exactly
            copy[part], part_scale, widened = _quantized(chunk, dtype)
            if part_scale is not None:
                scale[part] = part_scale
            with np.errstate(invalid="ignore"):  # rows that are not finite: inf below
                residual = np.linalg.norm(chunk.astype(np.float64) - widened, axis=1)
            rounding = _ROUNDING_PER_TERM * width * np.linalg.norm(widened, axis=1)
            bound[part] = np.where(np.isfinite(residual), residual + rounding, np.inf)
        self.screen = tf.constant(copy)
        self.scale = tf.constant(scale) if dtype == "int8" else None
        self._none = tf.zeros([0], tf.float32)  # the op's empty scale or bias
        # a hair over: float32 storage of the per-row constant must not round it down
        self.row_bound = tf.constant((bound * 1.0001).astype(np.float32))
        self.nbytes = self.bytes_for(self.weight.shape, layout, dtype)

    @staticmethod
    def bytes_for(shape, layout: str, dtype: str = "int8") -> int:
        """The memory a screen of a head of this shape and layout holds beside it: the copy's
        rows, and per vocabulary entry one float32 bound (and for int8 one scale)."""
        vocab = int(shape[0] if layout == "nk" else shape[1])
        per_row = 8 if dtype == "int8" else 4
        weight_bytes = 1 if dtype == "int8" else 2
        return weight_bytes * int(shape[0]) * int(shape[1]) + per_row * vocab

    def bounds(self, x):
        """x [S, D] float32 -> (approximate logits [S, vocab] with the bias, their error
        bounds, without the rounding of any noise added to them)."""
        if self.scale is not None:
            approx = screen_ops.int8_row_matmul(x, self.screen, self.scale)
        else:
            approx = screen_ops.half_matmul(x, self.screen)
        if self.bias is not None:  # before the screen: the bias moves the argmax
            approx = approx + self.bias
        return approx, tf.norm(x, axis=-1, keepdims=True) * self.row_bound

    def __call__(self, x, noise=None):
        """x [S, D] float32 (normed), noise float32 [S, vocab] or None -> [S, vocab]
        float32: logits + noise, exact (the float32 logits plus the noise) for every entry
        that could be the argmax of a row's logits + noise, the screen's approximation plus
        the noise elsewhere. One op (kernels/screened_logits.cc); `reference` is the same in TF
        ops."""
        return screen_ops.screened_logits(
            x, self.screen, self._none if self.scale is None else self.scale, self.row_bound,
            self.weight, self._none if self.bias is None else self.bias, layout=self.layout,
            noise=noise)

    def reference(self, x, noise=None):
        """`__call__` as TF ops over `bounds`; the candidates' logits summed in float32."""
        approx, bound = self.bounds(x)
        if noise is not None:  # with the rounding of the addition, as the op has it
            approx = approx + noise
            bound = bound + tf.abs(approx) * 2.0 ** -22
        floor = tf.reduce_max(approx - bound, axis=-1, keepdims=True)        # [S, 1]
        candidates = tf.where(approx + bound >= floor)                      # [C, 2]
        rows, entries = candidates[:, 0], candidates[:, 1]
        if self.layout == "nk":
            weights = tf.gather(self.weight, entries)                       # [C, D]
        else:
            weights = tf.transpose(tf.gather(self.weight, entries, axis=1))
        weights = tf.cast(weights, tf.float32)
        exact = tf.reduce_sum(weights * tf.gather(x, rows), axis=-1)        # [C]
        if self.bias is not None:
            exact = exact + tf.gather(self.bias, entries)
        if noise is not None:
            exact = exact + tf.gather_nd(noise, candidates)
        return tf.tensor_scatter_nd_update(approx, candidates, exact)


def screen_weights(model, weight_format: str, engine_config: EngineConfig):
    """(weight, layout, bias) of a float32 or bfloat16 LM head that greedy steps screen,
    or None (int8 weights, max_screened_head_rows 0, or no compiled screen matmul op).
    Read before the KV pool is sized, so a memory fraction counts the screen's copy."""
    if (not engine_config.max_screened_head_rows
            or model.compute_dtype not in ("float32", "bfloat16")
            or weight_format != "float"):
        return None
    if not screen_ops.is_compiled():  # its fallback writes a float32 copy: no gain
        log.info("LM head: no screen (%s)", screen_ops.kernel_status())
        return None
    if model.compute_dtype == "bfloat16":
        # greedy steps through the fused ops screen the head those ops would run: the
        # bfloat16 weights widened, float32 arithmetic (without the ops, none does)
        if engine_config.head_screen != "int8" or not kdense.is_compiled():
            log.info("LM head: no screen (%s)", "a float16 copy is as large as the "
                     "bfloat16 head" if kdense.is_compiled() else kdense.kernel_status())
            return None
    if model.head is None:  # tied: the token embedding [vocab, D]
        return model.token_embedding, "nk", None
    weights = model.head.weights_dict()
    return weights["kernel"], "kn", weights.get("bias")


def build_screen(screen, engine_config: EngineConfig) -> ScreenedHead | None:
    """The screen of the head `screen_weights` chose (None: no screen)."""
    if screen is None:
        return None
    head = ScreenedHead(*screen, dtype=engine_config.head_screen)
    log.info("LM head: greedy steps of up to %d rows screen it in %s (%.1f MB more), "
             "then compute in float32 only the entries that could be a row's argmax",
             engine_config.max_screened_head_rows, engine_config.head_screen,
             head.nbytes / 1e6)
    return head
