"""The LM head's screen: x @ w.T with w stored as float16 or as int8 with a scale per row,
and the whole screened head as one op (engine/step/head.py has the math).

    y = half_matmul(x, w16)              # x float32 [M, K], w16 float16 [N, K] -> [M, N]
    y = int8_row_matmul(x, q, scale)     # q int8 [N, K], scale float32 [N]: x @ (scale * q).T

A greedy decode step reads a float16 or int8 copy of the head, half or a quarter of the
float32 one's bytes; x stays float32 and the sums are float32 (`head_screen.cc`,
`screened_logits.cc`). Uses the compiled op when it is available, else the same product in
stock TF ops (also forced with TOKENSERVE_HALF_KERNEL=fallback or
TOKENSERVE_KERNELS=fallback), which writes a float32 copy of w on every call: correct, but
slower than the float32 head it stands in for, so the engine screens only where the op is
compiled (`is_compiled`).

`python -m tokenserve.kernels.head_screen` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tokenserve.kernels import build as kbuild

LIBRARY = kbuild.LIBRARIES["head_screen"]


def half_matmul(x, w, isa: str = "auto") -> tf.Tensor:
    """x float32 [M, K] @ w float16 [N, K].T -> float32 [M, N]."""
    op = LIBRARY.module()
    if op is None:
        return half_matmul_fallback(x, w)
    return op.tokenserve_half_matmul(x, w, isa=isa)


def half_matmul_fallback(x, w) -> tf.Tensor:
    return tf.matmul(tf.convert_to_tensor(x, tf.float32), tf.cast(w, tf.float32),
                     transpose_b=True)


def int8_row_matmul(x, w, scale, isa: str = "auto") -> tf.Tensor:
    """x float32 [M, K] @ (scale[:, None] * w).T, w int8 [N, K], scale float32 [N] -> float32
    [M, N]; each product is summed over the int8 values, then scaled once."""
    op = LIBRARY.module()
    if op is None:
        return int8_row_matmul_fallback(x, w, scale)
    return op.tokenserve_int8_row_matmul(x, w, scale, isa=isa)


def int8_row_matmul_fallback(x, w, scale) -> tf.Tensor:
    return tf.matmul(tf.convert_to_tensor(x, tf.float32), tf.cast(w, tf.float32),
                     transpose_b=True) * scale


def screened_logits(x, screen, scale, row_bound, weight, bias, layout: str,
                    isa: str = "auto", noise=None) -> tf.Tensor:
    """The screened LM head in one op (engine/step/head.py has the math): x float32
    [M, K] (normed); screen float16 or int8 [N, K] with scale [N] (int8) or [0]; row_bound
    [N]; weight the head, float32 or bfloat16, [N, K] ("nk") or [K, N] ("kn"); bias [N] or
    [0]; noise float32 [M, N] or None (or empty). Returns [M, N]: the float32 logit (plus
    noise) of every entry that could be the argmax of a row's logits plus its noise, the
    screen's value (plus noise) elsewhere. Compiled op only: callers check `is_compiled`
    first."""
    op = LIBRARY.module()
    if op is None:
        raise RuntimeError(f"the screened head needs the compiled op: {kernel_status()}")
    if noise is None:
        noise = tf.zeros([0, 0], tf.float32)
    return op.tokenserve_screened_logits(x, screen, scale, row_bound, weight, bias, noise,
                                         layout=layout, isa=isa)


def is_compiled() -> bool:
    """True when the compiled op is loaded and not forced off."""
    return LIBRARY.is_compiled()


def kernel_status() -> str:
    """One line: which path half_matmul takes here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
