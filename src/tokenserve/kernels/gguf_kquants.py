"""Pure-TF dequantization of GGUF K-quant super-blocks (256 values each), what
gguf.quants.dequantize gives for the same bytes: the portable path that SavedModel signatures
carry (stock TensorFlow ops only). Byte layouts as in gguf_kquants.h:

    Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    Q5_K 176 bytes: as Q4_K, with 32 bytes of high bits (qh) before the nibbles
    Q6_K 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
"""

from __future__ import annotations

import tensorflow as tf

KQUANT_TYPES = ("q4_k", "q5_k", "q6_k")
_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


_and, _or = tf.bitwise.bitwise_and, tf.bitwise.bitwise_or
_shr, _shl = tf.bitwise.right_shift, tf.bitwise.left_shift


def _half(b) -> tf.Tensor:
    """float32 [..., 1] from two bytes [..., 2] holding an fp16."""
    return tf.cast(tf.bitcast(b, tf.float16), tf.float32)[..., None]


def _scales_mins(packed) -> tuple[tf.Tensor, tf.Tensor]:
    """The 8 sub-blocks' 6-bit scales and mins, float32 [N, S, 8] each, from the 12 packed
    bytes [N, S, 12] (ggml's get_scale_min_k4): sub-blocks 0..3 in the low 6 bits of bytes
    0..3 (scales) and 4..7 (mins); 4..7 from bytes 8..11's nibbles and those bytes' top bits."""
    q = tf.cast(packed, tf.int32)
    lo, mid, hi = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = tf.concat([_and(lo, 63), _or(_and(hi, 15), _shl(_shr(lo, 6), 4))], axis=-1)
    mins = tf.concat([_and(mid, 63), _or(_shr(hi, 4), _shl(_shr(mid, 6), 4))], axis=-1)
    return tf.cast(scales, tf.float32), tf.cast(mins, tf.float32)


def _nibbles(qs) -> tf.Tensor:
    """int32 [N, S, 8, 32] from 128 nibble bytes [N, S, 128]: sub-blocks 2i and 2i + 1 are the
    low and high nibbles of bytes [32 i, 32 i + 32)."""
    q = tf.reshape(tf.cast(qs, tf.int32), tf.concat([tf.shape(qs)[:-1], [4, 32]], 0))
    both = tf.stack([_and(q, 15), _shr(q, 4)], axis=-2)  # [N, S, 4, 2, 32]
    return tf.reshape(both, tf.concat([tf.shape(qs)[:-1], [8, 32]], 0))


def dequantize_kquants(blocks, name: str) -> tf.Tensor:
    """uint8 [N, K / 256 * block bytes] of `name` (q4_k, q5_k, q6_k) -> float32 [N, K]."""
    blocks = tf.convert_to_tensor(blocks, tf.uint8)
    n = tf.shape(blocks)[0]
    b = tf.reshape(blocks, [n, -1, _BYTES[name]])  # [N, S, block bytes]
    if name == "q6_k":
        ql = tf.reshape(tf.cast(b[..., 0:128], tf.int32), [n, -1, 2, 2, 32])  # half, which 32
        qh = tf.reshape(tf.cast(b[..., 128:192], tf.int32), [n, -1, 2, 1, 32])
        low = tf.reshape(tf.stack([_and(ql, 15), _shr(ql, 4)], axis=3), [n, -1, 2, 4, 32])
        shifts = tf.reshape(tf.constant([0, 2, 4, 6]), [4, 1])
        v = _or(low, _shl(_and(_shr(qh, shifts), 3), 4))  # [N, S, 2, 4, 32], value order
        v = tf.cast(tf.reshape(v, [n, -1, 16, 16]), tf.float32) - 32.0  # sub-blocks of 16
        scales = tf.cast(tf.bitcast(b[..., 192:208], tf.int8), tf.float32)[..., None]
        w = _half(b[..., 208:210])[..., None] * scales * v
        return tf.reshape(w, [n, -1])
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [N, S, 1]
    scales, mins = _scales_mins(b[..., 4:16])
    if name == "q4_k":
        v = _nibbles(b[..., 16:144])
    else:
        qh = tf.cast(b[..., 16:48], tf.int32)[..., None, :]  # [N, S, 1, 32]
        high = _and(_shr(qh, tf.reshape(tf.range(8), [8, 1])), 1)  # bit j: sub-block j's bit 4
        v = _or(_nibbles(b[..., 48:176]), _shl(high, 4))
    w = (d * scales)[..., None] * tf.cast(v, tf.float32) - (dmin * mins)[..., None]
    return tf.reshape(w, [n, -1])
