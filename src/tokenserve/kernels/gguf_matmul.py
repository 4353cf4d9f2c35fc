"""Matrix multiply by GGUF weights kept in the blocks the file stores (Q4_0, Q4_1, Q5_0, Q8_0,
and the K-quants Q4_K, Q5_K, Q6_K).

ggml stores a [N, K] weight (N outputs, K inputs contiguous) as N rows of blocks of 32
values: Q4_0 18 bytes a block, Q4_1 20, Q5_0 22, Q8_0 34; or of super-blocks of 256: Q4_K 144 bytes,
Q5_K 176, Q6_K 210. The op (`gguf_matmul.cc`) takes those bytes as they are, a uint8 tensor
[N, K / values * block bytes], so an import can keep a tensor as the file holds it (4.5-8.5
bits a weight instead of 32):

    tensor = gguf.GGUFReader(path).tensors[i]                 # e.g. blk.0.attn_q.weight
    y = gguf_matmul(x, tensor.data, tensor.tensor_type.name)  # x [M, K] -> y [M, N]

The compiled op quantizes x once per call into int8 blocks of 32 (a float scale each; error up
to 1/254 of the block's absmax per value), for the K-quants into q8_K blocks of 256 (a unit
step per 256 values and an integer multiple of it, 1 to 16, per 8), and takes integer dot
products against the weight blocks, as llama.cpp does.
Without a compiler, or with TOKENSERVE_GGUF_KERNEL=fallback, a pure-TF path dequantizes the
whole weight each call and multiplies in float32: exact up to float rounding, slower, and what
stock TensorFlow can run.

Environment (building and loading are shared with the other ops: tokenserve.kernels.build):
  TOKENSERVE_GGUF_KERNEL=fallback   use the pure-TF path (read each time a graph is traced)
  TOKENSERVE_GGUF_KERNEL_MARCH=...  target of the build ("native", "avx2" or any -march value)

`python -m tokenserve.kernels.gguf_matmul` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tokenserve.kernels import build as kbuild
from tokenserve.kernels.gguf_kquants import KQUANT_TYPES, dequantize_kquants
from tokenserve.kernels.gguf_packed import PACKED, TILE_ROWS, unpack_rows
from tokenserve.kernels.gguf_types import BLOCK_SIZES, KERNEL_TYPES

LIBRARY = kbuild.LIBRARIES["gguf_matmul"]
MODE_ENV = LIBRARY.mode_env  # TOKENSERVE_GGUF_KERNEL
MARCH_ENV = LIBRARY.march_env  # TOKENSERVE_GGUF_KERNEL_MARCH

_SIZES = {**{name: BLOCK_SIZES[name] for name in KERNEL_TYPES},
          **{packed: BLOCK_SIZES[base] for packed, base in PACKED.items()}}
BLOCK_VALUES = {name: size[0] for name, size in _SIZES.items()}  # 32, or 256 (K-quants)
BLOCK_BYTES = {name: size[1] for name, size in _SIZES.items()}


def block_type_name(block_type) -> str:
    """The op's name for a block type: "q4_1" from "Q4_1", "q4_1" or a
    gguf.GGMLQuantizationType. Raises ValueError for a type without a kernel."""
    name = str(getattr(block_type, "name", block_type)).lower()
    if name not in BLOCK_BYTES:
        raise ValueError(f"no GGUF block kernel for {name!r}; "
                         f"supported: {', '.join(sorted(BLOCK_BYTES))}")
    return name


def blocks_mismatch(block_type, k: int, row_bytes: int) -> str | None:
    """Why rows of `row_bytes` bytes of `block_type` cannot hold K values (the op's message),
    or None when they can."""
    name = block_type_name(block_type)
    values = BLOCK_VALUES[name]
    if k % values:
        return f"x's K = {k} does not divide into {name} blocks of {values} values"
    want = k // values * BLOCK_BYTES[name]
    if row_bytes != want:
        return (f"{name} weights for K = {k} need {want} bytes a row ({k // values} "
                f"blocks of {BLOCK_BYTES[name]}), but blocks has {row_bytes}")
    return None


def _check_static_shapes(x: tf.Tensor, blocks: tf.Tensor, name: str) -> None:
    if x.shape.rank != 2 or blocks.shape.rank != 2:
        raise ValueError(f"gguf_matmul needs x [M, K] and blocks [N, bytes a row], got "
                         f"{x.shape} and {blocks.shape}")
    k, row_bytes = x.shape[1], blocks.shape[1]
    if k is not None and row_bytes is not None:
        why = blocks_mismatch(name, k, row_bytes)
        if why:
            raise ValueError(why)
    rows = blocks.shape[0]
    if name in PACKED and rows is not None and rows % TILE_ROWS:
        raise ValueError(f"{name} weights come in tiles of {TILE_ROWS} rows, but blocks has "
                         f"{rows}")


def gguf_matmul(x, blocks, block_type) -> tf.Tensor:
    """x [M, K] @ dequant(blocks [N, K / values * block bytes] uint8).T -> [M, N] in x's dtype.

    block_type: "q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k" or "q6_k" (any case, or a
    gguf.GGMLQuantizationType), or "q4_0x8", "q4_1x8", "q5_0x8" for rows repacked into 8-row
    tiles at load (gguf_packed.py).
    x is float32; bfloat16 and float16 are computed in float32 and cast back. Uses the compiled
    op when it is available, else `gguf_matmul_fallback`; works eagerly and inside tf.function
    (the choice is made when the graph is traced). Raises ValueError when the shapes, as far
    as they are known, do not fit (the op refuses them at run time otherwise).
    """
    name = block_type_name(block_type)
    x = tf.convert_to_tensor(x)
    if x.dtype in (tf.bfloat16, tf.float16):
        return tf.cast(gguf_matmul(tf.cast(x, tf.float32), blocks, name), x.dtype)
    if x.dtype != tf.float32:
        raise TypeError(f"gguf_matmul needs float32 (or bfloat16/float16) x, got {x.dtype.name}")
    blocks = tf.convert_to_tensor(blocks, tf.uint8)
    _check_static_shapes(x, blocks, name)
    op = LIBRARY.module()
    if op is None:
        return gguf_matmul_fallback(x, blocks, name)
    return op.tokenserve_gguf_matmul(x, blocks, block_type=name)


def gguf_finish_block(attn, x, out, norm, up, down, activation: str = "gelu_tanh",
                      eps: float = 1e-5, isa: str = "auto", next_norm=None, next_qkv=None,
                      post_attn_norm=None, post_mlp_norm=None):
    """The second half of a transformer block with GGUF weights as stored, as one op:

        x1 = attn @ out.T + out_bias + x           (x + post_attn_norm(attn @ out.T + bias))
        y  = act(norm(x1) @ up.T + up_bias) @ down.T + down_bias + x1    (likewise)

    out, up, down: {"parts": [(block type, uint8 blocks), ...] in row order, "bias": ...
    or absent}; norm, next_norm, post_*_norm: dicts with "scale" (and "bias" for
    LayerNorm). The arithmetic of gguf_matmul followed by dense.epilogue and dense.layer_norm,
    in one op so the matrices stream back to back. With next_norm and next_qkv, the op goes
    on with `next = next_norm(y) @ next_qkv.T + bias` and returns (y, next); else y. None
    when the compiled op is unavailable: the caller composes the separate ops then.
    """
    op = LIBRARY.module()
    if op is None:
        return None
    empty = tf.zeros([0], tf.float32)

    def vector(w, key="bias"):
        return w[key] if w is not None and w.get(key) is not None else empty

    def parts(w):
        return ([tf.convert_to_tensor(b, tf.uint8) for _, b in w["parts"]],
                [block_type_name(name) for name, _ in w["parts"]])

    (out_b, out_t), (up_b, up_t), (down_b, down_t) = parts(out), parts(up), parts(down)
    next_b, next_t = parts(next_qkv) if next_qkv is not None else ([], [])
    y, following = op.tokenserve_gguf_finish_block(
        attn, x, out_b, vector(out), norm["scale"], vector(norm), up_b, vector(up), down_b,
        vector(down), vector(post_attn_norm, "scale"), vector(post_mlp_norm, "scale"),
        vector(next_norm, "scale"), vector(next_norm), next_b, vector(next_qkv),
        out_types=out_t, up_types=up_t, down_types=down_t, next_types=next_t,
        activation=activation, eps=eps, isa=isa)
    return y if next_qkv is None else (y, following)


def dequantize_blocks(blocks, block_type) -> tf.Tensor:
    """Pure TF: uint8 [N, K / values * block bytes] -> float32 [N, K], what
    gguf.quants.dequantize gives for the same bytes (up to float rounding of d * v + m)."""
    name = block_type_name(block_type)
    size = BLOCK_BYTES[name]
    blocks = tf.convert_to_tensor(blocks, tf.uint8)
    if name in PACKED:  # tiles repacked at load (gguf_packed.py): the file's rows first
        return dequantize_blocks(unpack_rows(blocks, name), PACKED[name])
    if name in KQUANT_TYPES:
        return dequantize_kquants(blocks, name)
    n = tf.shape(blocks)[0]
    b = tf.reshape(blocks, [n, -1, size])  # [N, K / 32, block bytes]
    d = tf.cast(tf.bitcast(b[..., 0:2], tf.float16), tf.float32)[..., None]  # [N, K / 32, 1]
    if name == "q8_0":
        w = tf.cast(tf.bitcast(b[..., 2:], tf.int8), tf.float32) * d
    else:
        nibbles = b[..., size - 16:]  # byte j: value j low, value j + 16 high
        v = tf.cast(tf.concat([tf.bitwise.bitwise_and(nibbles, 15),
                               tf.bitwise.right_shift(nibbles, 4)], axis=-1), tf.float32)
        if name == "q5_0":  # bit j of the uint32 at bytes 2..5: value j's fifth bit
            high = tf.bitcast(b[..., 2:6], tf.int32)[..., None]            # [N, K / 32, 1]
            shifts = tf.range(32, dtype=tf.int32)  # (int32: TF has no uint32 shift kernel)
            bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(high, shifts), 1)  # [.., 32]
            w = (v + 16.0 * tf.cast(bits, tf.float32) - 16.0) * d
        elif name == "q4_0":
            w = (v - 8.0) * d
        else:
            m = tf.cast(tf.bitcast(b[..., 2:4], tf.float16), tf.float32)[..., None]
            w = v * d + m
    return tf.reshape(w, [n, -1])


def gguf_matmul_fallback(x, blocks, block_type) -> tf.Tensor:
    """Pure-TF x [M, K] float32 @ dequantize_blocks(blocks).T: exact up to float rounding (no
    activation quantization), but it writes a float32 copy of the weights every call."""
    name = block_type_name(block_type)
    x = tf.convert_to_tensor(x, tf.float32)
    blocks = tf.convert_to_tensor(blocks, tf.uint8)
    _check_static_shapes(x, blocks, name)
    return tf.matmul(x, dequantize_blocks(blocks, name), transpose_b=True)


def compiled_gguf_matmul(x, blocks, block_type, isa: str = "auto") -> tf.Tensor:
    """The compiled op with its kernel choice exposed (tests and benchmarks), no static checks:
    the op's own refusal is what callers see.

    isa: "auto" (AVX512-VNNI where the build and the CPU have it, else AVX2+FMA+F16C where the
        CPU has that), "avx2" (at most AVX2) or "scalar" (the portable path).
    Raises RuntimeError if the op is unavailable.
    """
    loaded = LIBRARY.load()
    if isinstance(loaded, str):
        raise RuntimeError(f"GGUF block matmul op unavailable: {loaded}")
    return loaded[0].tokenserve_gguf_matmul(x, blocks, block_type=block_type_name(block_type),
                                            isa=isa)


def reads_packed_faster() -> bool:
    """Whether Q4_0/Q4_1/Q5_0 rows repacked into 8-row tiles (gguf_packed.py) are worth it here:
    the compiled op runs with SIMD kernels. On its scalar path, or the pure-TF fallback, each
    call would unpack the tiles first, so the file's rows stay as they are."""
    op = LIBRARY.module()
    return op is not None and not op.tokenserve_gguf_matmul_info().numpy().startswith(b"scalar")


def kernel_status() -> str:
    """One line: which path gguf_matmul takes here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
