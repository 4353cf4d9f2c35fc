"""x @ w.T with w stored as float16, for the LM head's screen (engine/screened_head.py).

    y = half_matmul(x, w16)     # x float32 [M, K], w16 float16 [N, K] -> float32 [M, N]

A greedy decode step reads a float16 copy of the head, half the bytes of the float32 one;
x stays float32 and the sums are float32 (`half_matmul.cc`). Uses the compiled op when it
is available, else the same product in stock TF ops (also forced with
TOKENSERVE_HALF_KERNEL=fallback or TOKENSERVE_KERNELS=fallback), which writes a float32
copy of w on every call: correct, but slower than the float32 head it stands in for, so the
engine screens only where the op is compiled (`is_compiled`).

`python -m tokenserve.kernels.half_matmul` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging
from pathlib import Path

import tensorflow as tf

from tokenserve.kernels import build as kbuild

LIBRARY = kbuild.OpLibrary(Path(__file__).with_name("half_matmul.cc"), "float16 matmul op",
                           mode_env="TOKENSERVE_HALF_KERNEL")


def half_matmul(x, w, isa: str = "auto") -> tf.Tensor:
    """x float32 [M, K] @ w float16 [N, K].T -> float32 [M, N]."""
    op = LIBRARY.module()
    if op is None:
        return half_matmul_fallback(x, w)
    return op.tokenserve_half_matmul(x, w, isa=isa)


def half_matmul_fallback(x, w) -> tf.Tensor:
    return tf.matmul(tf.convert_to_tensor(x, tf.float32), tf.cast(w, tf.float32),
                     transpose_b=True)


def is_compiled() -> bool:
    """True when the compiled op is loaded and not forced off."""
    return LIBRARY.is_compiled()


def kernel_status() -> str:
    """One line: which path half_matmul takes here, and why (builds the op if needed)."""
    return LIBRARY.status("tokenserve_half_matmul_info")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
