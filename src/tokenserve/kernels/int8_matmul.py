"""int8-weight matrix multiply for CPU decode, usable in graph-mode tf.function (no XLA).

A decode step (batch 1..32) is bound by reading the weights, so they are stored as int8
(one byte each, 4x less than float32) with float32 scales, and multiplied by a TF custom op
written in C++ with AVX2 intrinsics (`int8_matmul.cc`). The op is compiled from source on
first use with the local g++ and TensorFlow's own compile flags, and cached under
`tokenserve.host.user_cache.cache_dir("kernels")`. Without a compiler, or with
TOKENSERVE_INT8_KERNEL=fallback, a pure-TF fallback computes nearly the same numbers
(it dequantizes the whole weight each call, so it is slower than float32).

    q, scale = quantize_weight(dense.kernel.numpy())      # [N, K] int8, [N, G] float32
    y = int8_matmul(x, q, scale)                           # x [M, K] -> y [M, N]
    y = int8_finish_block(attn, x, out, norm, up, down)    # a block's second half, one op

Environment (building and loading are shared with the other ops: tokenserve.kernels.build):
  TOKENSERVE_INT8_KERNEL=fallback   use the pure-TF path (read each time a graph is traced);
                                    TOKENSERVE_KERNELS=fallback does it for every op
  TOKENSERVE_INT8_KERNEL_MARCH=...  target of the build: "native" (default), "avx2"
                                    (-mavx2 -mfma), or any -march value; defaults to
                                    TOKENSERVE_KERNELS_MARCH when unset

`python -m tokenserve.kernels.int8_matmul` builds the op and prints kernel_status()
(`python -m tokenserve.kernels.build` builds every op).
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tokenserve.kernels import build as kbuild

log = logging.getLogger("tokenserve.kernels")

LIBRARY = kbuild.LIBRARIES["int8_matmul"]
MODE_ENV = LIBRARY.mode_env  # TOKENSERVE_INT8_KERNEL
MARCH_ENV = LIBRARY.march_env  # TOKENSERVE_INT8_KERNEL_MARCH


# ---------------------------------------------------------------------------------------------
# Quantization


def quantize_weight(kernel: np.ndarray, group_size: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of a Dense kernel.

    kernel: float [K, N] (Keras layout, inputs x outputs).
    Returns q int8 [N, K] (transposed: each output's weights contiguous) and scale float32
    [N, G], G = K // group_size (G = 1, one scale per output channel, when group_size is
    None), with kernel.T ~= q * scale repeated over each group's K // G columns.
    scale = absmax / 127 per row or group; an all-zero one gets scale 1 (q is 0 there).
    """
    w = np.asarray(kernel, dtype=np.float32).T  # [N, K]
    n, k = w.shape
    if group_size is None:
        group_size = k
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide K = {k}")
    groups = w.reshape(n, k // group_size, group_size)
    scale = np.abs(groups).max(axis=2, initial=0.0) / 127.0  # [N, G]
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(groups / scale[:, :, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.reshape(n, k)), scale.astype(np.float32)


def dequantize_weight(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q int8 [N, K], scale [N, G] -> float32 [N, K] (the inverse of quantize_weight, .T)."""
    n, k = q.shape
    g = scale.shape[1]
    w = q.astype(np.float32).reshape(n, g, k // g) * scale[:, :, None]
    return w.reshape(n, k)


# ---------------------------------------------------------------------------------------------
# The matmul


def int8_matmul(x, q, scale) -> tf.Tensor:
    """x [M, K] @ dequant(q [N, K] int8, scale [N, G] float32).T -> [M, N] in x's dtype.

    q must lie in [-127, 127], as quantize_weight makes it (the op's AVX2 path cannot use
    -128). The compiled op quantizes x per 32-value block to int8 (error up to 1/254 of the
    block's absmax per value); the fallback does not.

    x is float32; bfloat16 and float16 are computed in float32 and cast back. Uses the
    compiled op when it is available, else `int8_matmul_fallback`. Works eagerly and inside
    tf.function (the choice is made when the graph is traced).
    """
    x = tf.convert_to_tensor(x)
    if x.dtype in (tf.bfloat16, tf.float16):
        return tf.cast(int8_matmul(tf.cast(x, tf.float32), q, scale), x.dtype)
    if x.dtype != tf.float32:
        raise TypeError(f"int8_matmul needs float32 (or bfloat16/float16) x, got {x.dtype.name}")
    op = LIBRARY.module()
    if op is None:
        return int8_matmul_fallback(x, q, scale)
    return op.tokenserve_int8_matmul(x, q, scale)


def int8_matmul_fallback(x, q, scale) -> tf.Tensor:
    """Pure-TF x [M, K] float32 @ dequant(q, scale).T: exact up to float rounding (no
    activation quantization), but it reads q and writes a float32 copy of it every call."""
    x = tf.convert_to_tensor(x, tf.float32)
    q = tf.convert_to_tensor(q, tf.int8)
    scale = tf.convert_to_tensor(scale, tf.float32)
    w = tf.cast(q, tf.float32)  # [N, K]
    if scale.shape.rank == 2 and scale.shape[1] == 1:
        # One scale per output: scale the [M, N] product instead of the [N, K] weights.
        return tf.matmul(x, w, transpose_b=True) * scale[:, 0]
    n, k, g = tf.shape(q)[0], tf.shape(q)[1], tf.shape(scale)[1]
    tf.debugging.assert_equal(k % g, 0, message="scale's group count G must divide K")
    w = tf.reshape(tf.reshape(w, [n, g, k // g]) * scale[:, :, None], [n, k])
    return tf.matmul(x, w, transpose_b=True)


def int8_finish_block(attn, x, out, norm, up, down, activation: str = "gelu_tanh",
                      eps: float = 1e-5, isa: str = "auto", next_norm=None, next_qkv=None):
    """The second half of a transformer block with int8 weights, as one compiled op:

        x1 = attn @ out.T + out_bias + x
        y  = act(norm(x1) @ up.T + up_bias) @ down.T + down_bias + x1

    out, up, down: dicts with "q" and "scale" (and "bias" when the layer has one); norm: a
    dict with "scale" (and "bias" for LayerNorm; without it RMSNorm). activation:
    "gelu_tanh" or "swiglu" (up's output is [gate, up] halves). The same arithmetic as
    int8_matmul followed by dense.epilogue and dense.layer_norm, in one op so the three
    matrices stream back to back (docs/performance.md). Returns y, or None when the
    compiled op is unavailable: the caller composes the separate ops then.

    With next_norm and next_qkv (the next block's attention norm and int8 QKV projection,
    dicts as above), the op goes on with `next = next_norm(y) @ next_qkv.T + bias` and
    returns (y, next).
    """
    op = LIBRARY.module()
    if op is None:
        return None
    empty = tf.zeros([0], tf.float32)

    def bias(w):
        return w["bias"] if w.get("bias") is not None else empty

    if next_qkv is None:
        following = (empty, empty, tf.zeros([0, 0], tf.int8), tf.zeros([0, 0], tf.float32),
                     empty)
    else:
        following = (next_norm["scale"], bias(next_norm), next_qkv["q"], next_qkv["scale"],
                     bias(next_qkv))
    y, following = op.tokenserve_int8_finish_block(
        attn, x, out["q"], out["scale"], bias(out), norm["scale"], bias(norm),
        up["q"], up["scale"], bias(up), down["q"], down["scale"], bias(down), *following,
        activation=activation, eps=eps, isa=isa)
    return y if next_qkv is None else (y, following)


def compiled_int8_matmul(x, q, scale, activations: str = "int8", isa: str = "auto"):
    """The compiled op with its kernel choices exposed (tests and benchmarks).

    activations: "int8" (default; x quantized per 32-block) or "float" (exact, slower).
    isa: "auto" (AVX512-VNNI for the int8 kernel where the CPU has it, else AVX2+FMA where
        it has that), "avx2" (at most AVX2+FMA) or "scalar" (the portable path).
    Raises RuntimeError if the op is unavailable.
    """
    loaded = LIBRARY.load()
    if isinstance(loaded, str):
        raise RuntimeError(f"int8 op unavailable: {loaded}")
    return loaded[0].tokenserve_int8_matmul(x, q, scale, activations=activations, isa=isa)


def kernel_status() -> str:
    """One line: which path int8_matmul takes here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
