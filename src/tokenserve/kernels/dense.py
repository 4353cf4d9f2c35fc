"""Dense layers and norms for small decode batches, in graph mode (no XLA): float32
activations, float32 or bfloat16 weights.

A batch-1 decode step is bound by reading the weights (GPT-2-small: 498 MB of float32 per
token). XLA's matmuls stream them near the machine's bandwidth, but its CPU runtime spends
several more milliseconds a step between the small fusions around them (norms, bias adds,
GELU), and graph-mode TF costs ~10 us per op. The dense library makes each dense layer one op
(`dense.cc`), with its bias, activation (GPT-2's tanh GELU, or SwiGLU) and residual add
fused, and each norm one op (`row_ops.cc`); the engine uses them for steps of a few tokens
(docs/engine.md, "The step").

    y = dense(x, kernel, bias, residual=x0, activation="gelu_tanh")   # x [M, K] -> [M, N]
    logits = dense(h, embedding, layout="nk")                          # tied LM head
    h = layer_norm(x, scale, bias, eps=1e-5)
    y = finish_block(attn, x, out, norm, up, down)   # a block's second half, one op

Each function uses the compiled op when it is available, else the same math in stock TF ops
(also forced with TOKENSERVE_DENSE_KERNEL=fallback or TOKENSERVE_KERNELS=fallback). The op
is built from source on first use (tokenserve.kernels.build).

`python -m tokenserve.kernels.dense` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tokenserve.kernels import build as kbuild

LIBRARY = kbuild.LIBRARIES["dense"]

ACTIVATIONS = ("none", "gelu_tanh", "swiglu", "geglu")
GATED = ("swiglu", "geglu")  # [gate, up] halves in, half as many values out


def dense(x, w, bias=None, residual=None, layout: str = "kn", activation: str = "none",
          isa: str = "auto") -> tf.Tensor:
    """activation(x @ W + bias) + residual for float32 x [M, K].

    w: [K, N] (layout "kn") or [N, K] ("nk"), float32 or bfloat16 (widened to float32 as it
    is read: half the bytes to stream, float32 arithmetic). bias: [N] or None. residual: [M, out] or None.
    activation: "none", "gelu_tanh", "swiglu" (out = N / 2: silu(z[:, :N/2]) * z[:, N/2:]) or
    "geglu" (out = N / 2: gelu_tanh(z[:, :N/2]) * z[:, N/2:], Gemma's).
    isa: "auto" or "scalar" (the op's portable path; tests).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    op = LIBRARY.module()
    if op is None:
        return dense_fallback(x, w, bias, residual, layout, activation)
    empty = tf.zeros([0], tf.float32)
    return op.tokenserve_dense(x, w, empty if bias is None else bias,
                               tf.zeros([0, 0], tf.float32) if residual is None else residual,
                               layout=layout, activation=activation, isa=isa)


def dense_fallback(x, w, bias=None, residual=None, layout: str = "kn",
                   activation: str = "none") -> tf.Tensor:
    """`dense` in stock TF ops."""
    w = tf.convert_to_tensor(w)
    if w.dtype != tf.float32:  # bfloat16 weights: float32 arithmetic, as the op does
        w = tf.cast(w, tf.float32)
    return epilogue_fallback(tf.matmul(x, w, transpose_b=layout == "nk"), bias, residual,
                             activation)


def epilogue(z, bias=None, residual=None, activation: str = "none",
             isa: str = "auto") -> tf.Tensor:
    """`dense`'s epilogue on a finished product z [M, N]: activation(z + bias) + residual
    (the int8 weights' path: TokenserveInt8Matmul, then this)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    op = LIBRARY.module()
    if op is None:
        return epilogue_fallback(z, bias, residual, activation)
    return op.tokenserve_epilogue(
        z, tf.zeros([0], tf.float32) if bias is None else bias,
        tf.zeros([0, 0], tf.float32) if residual is None else residual,
        activation=activation, isa=isa)


def epilogue_fallback(z, bias=None, residual=None, activation: str = "none") -> tf.Tensor:
    z = tf.convert_to_tensor(z, tf.float32)
    if bias is not None:
        z = z + bias
    if activation == "gelu_tanh":
        z = tf.nn.gelu(z, approximate=True)
    elif activation in GATED:
        gate, up = tf.split(z, 2, axis=-1)
        z = (tf.nn.silu(gate) if activation == "swiglu"
             else tf.nn.gelu(gate, approximate=True)) * up
    return z if residual is None else z + residual


def layer_norm(x, scale, bias=None, eps: float = 1e-5, isa: str = "auto") -> tf.Tensor:
    """LayerNorm of float32 x [M, D] (scale, bias [D]), or RMSNorm when bias is None."""
    op = LIBRARY.module()
    if op is None:
        return layer_norm_fallback(x, scale, bias, eps)
    return op.tokenserve_norm(x, scale, tf.zeros([0], tf.float32) if bias is None else bias,
                              eps=eps, isa=isa)


def layer_norm_fallback(x, scale, bias=None, eps: float = 1e-5) -> tf.Tensor:
    if bias is None:
        return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + eps) * scale
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + eps) * scale + bias


def finish_block(attn, x, out, norm, up, down, activation: str = "gelu_tanh",
                 eps: float = 1e-5, isa: str = "auto", next_norm=None, next_qkv=None,
                 post_attn_norm=None, post_mlp_norm=None):
    """The second half of a transformer block with float32 or bfloat16 weights (all four
    matrices the same; float32 arithmetic either way), as one compiled op:

        x1 = attn @ out_kernel + out_bias + x
        y  = act(norm(x1) @ up_kernel + up_bias) @ down_kernel + down_bias + x1

    out, up, down: dicts with "kernel" ([in, out]) and "bias" where the layer has one; norm:
    a dict with "scale" (and "bias" for LayerNorm; without it RMSNorm). activation:
    "gelu_tanh", "swiglu" or "geglu" (up's output is [gate, up] halves). The same kernels as three
    `dense` calls and a `layer_norm`, in one op so the three matrices stream back to back
    (docs/performance.md). Returns y, or None when the compiled op is unavailable: the
    caller composes the separate functions then.

    With next_norm and next_qkv (the next block's attention norm and QKV projection, dicts
    as above), the op goes on with `next = next_norm(y) @ next_qkv + bias` and returns
    (y, next). With post_attn_norm and post_mlp_norm (Gemma's RMSNorms of each branch's
    output, dicts with "scale"), x1 = x + post_attn_norm(attn @ out_kernel + out_bias) and
    y = x1 + post_mlp_norm(... @ down_kernel + down_bias).
    """
    if activation not in ("gelu_tanh", *GATED):
        raise ValueError(f"activation must be gelu_tanh, swiglu or geglu, got {activation!r}")
    op = LIBRARY.module()
    if op is None:
        return None
    empty = tf.zeros([0], tf.float32)

    def bias(w):
        return w["bias"] if w.get("bias") is not None else empty

    if next_qkv is None:
        following = (empty, empty, tf.zeros([0, 0], out["kernel"].dtype), empty)
    else:
        following = (next_norm["scale"], bias(next_norm), next_qkv["kernel"], bias(next_qkv))
    post = ((post_attn_norm["scale"], post_mlp_norm["scale"]) if post_attn_norm is not None
            else (empty, empty))
    y, following = op.tokenserve_finish_block(
        attn, x, out["kernel"], bias(out), norm["scale"], bias(norm), up["kernel"], bias(up),
        down["kernel"], bias(down), *following, *post, activation=activation, eps=eps,
        isa=isa)
    return y if next_qkv is None else (y, following)


LORA_ROLES = ("qkv", "out", "up", "down")
"""The roles of the LoRA ops' spans, in their order."""
LORA_PIECES = 3
"""Pieces of one role's factor a span row holds at most (a fused QKV's q, k and v)."""


def full_lora_spans(factors: dict) -> list:
    """Spans for S slots that fill their factors whole (one piece per role: every rank row
    on every column): factors as lora_finish_block takes them (a dict of the roles it
    has)."""
    first_a, first_b = next(iter(factors.values()))
    layers = first_a[0].shape[0]
    span = np.zeros([layers, len(LORA_ROLES), LORA_PIECES, 4], np.int32)
    for role, (a, b) in factors.items():
        span[:, LORA_ROLES.index(role), 0] = [0, b[0].shape[1], 0, b[0].shape[2]]
    return [tf.constant(span)] * len(first_a)


def lora_finish_block(attn, x, out, norm, up, down, groups, factors: dict, layer: int,
                      activation: str = "gelu_tanh", eps: float = 1e-5, isa: str = "auto",
                      next_norm=None, next_qkv=None, spans: list | None = None):
    """finish_block with each row's LoRA delta on its four projections, in the same one op:

        proj(in)[row] = in[row] @ kernel + bias + (in[row] @ A_s[layer]) @ B_s[layer]

    for the row's slot s, rows grouped by slot (lora_delta's `groups`). factors: role ("out",
    "up", "down", "qkv": the next block's, read at layer + 1) -> (A, B): lists of the S
    slots' A_s [L, in, R] and B_s [L, R, out] float32, the slot table's variables as they
    are. spans: the S slots' int32 [L, 4, LORA_PIECES, 4], per layer and role (LORA_ROLES)
    the pieces (rank rows r0..r1 of B nonzero only in columns c0..c1) that the op reads;
    None: every factor whole. Returns what finish_block returns, None likewise."""
    op = LIBRARY.module()
    if op is None:
        return None
    if spans is None:
        spans = full_lora_spans(factors)
    empty = tf.zeros([0], tf.float32)

    def bias(w):
        return w["bias"] if w.get("bias") is not None else empty

    if next_qkv is None:
        following = (empty, empty, tf.zeros([0, 0], out["kernel"].dtype), empty)
    else:
        following = (next_norm["scale"], bias(next_norm), next_qkv["kernel"], bias(next_qkv))
    lists = [list(f) for role in ("out", "up", "down", "qkv") for f in factors[role]]
    y, following = op.tokenserve_lora_finish_block(
        attn, x, out["kernel"], bias(out), norm["scale"], bias(norm), up["kernel"], bias(up),
        down["kernel"], bias(down), *following, *groups, *lists, list(spans), layer=layer,
        activation=activation, eps=eps, isa=isa)
    return y if next_qkv is None else (y, following)


def lora_delta(y, x, groups, a: list, b: list, layer: int, spans: list | None = None,
               role: str = "qkv"):
    """y [M, out] + each row's LoRA delta (x[row] @ A_s[layer]) @ B_s[layer] for its slot s,
    float32, or None when the compiled op is unavailable.

    groups: (order [M] int32, the rows sorted by slot; offsets [S + 2] int32, slot s's rows
    order[offsets[s]:offsets[s + 1]], slot 0 (no adapter) getting none); a, b: the S
    slots' A_s [L, in, R] and B_s [L, R, out]; spans, role: lora_finish_block's spans and
    the role (LORA_ROLES) of these factors; None: the factors whole."""
    op = LIBRARY.module()
    if op is None:
        return None
    if spans is None:
        spans = full_lora_spans({role: (a, b)})
    return op.tokenserve_lora_delta(y, x, *groups, list(a), list(b), list(spans), layer=layer,
                                    role=LORA_ROLES.index(role))


def split_rope(qkv, num_heads: int, num_kv_heads: int, head_dim: int, rotary=None,
               q_norm=None, k_norm=None, eps: float = 1e-6):
    """float32 qkv [N, (H + 2 Hkv) Dh] -> (q [N, H, Dh], k [N, Hkv Dh], v [N, Hkv Dh]), with
    rotary = (cos, sin), each [N, R] (or None), applied to q and k as
    model.layers.apply_rope applies it (the same float32 roundings): R = Dh turns whole
    heads, R < Dh (a partial rotary) each head's first R dimensions. q_norm, k_norm: QK-norm's
    RMSNorm scales [Dh] (both or neither), applied to each q and k head before RoPE."""
    op = LIBRARY.module()
    if op is None:
        return split_rope_fallback(qkv, num_heads, num_kv_heads, head_dim, rotary, q_norm,
                                   k_norm, eps)
    empty = tf.zeros([0], tf.float32)
    cos, sin = rotary if rotary is not None else (empty, empty)
    norms = (q_norm, k_norm) if q_norm is not None else (empty, empty)
    q, k, v = op.tokenserve_split_rope(qkv, cos, sin, *norms, num_heads=num_heads,
                                       num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps)
    return q, k, v


def split_rope_fallback(qkv, num_heads: int, num_kv_heads: int, head_dim: int, rotary=None,
                        q_norm=None, k_norm=None, eps: float = 1e-6):
    """split_rope in stock TF ops: the engine's graph path, RoPE written out as
    model.layers.apply_rope computes it (kernels sit below the model package;
    tests/kernels/test_split_rope.py checks both against apply_rope bit for bit)."""
    width = num_kv_heads * head_dim
    q, k, v = tf.split(qkv, [num_heads * head_dim, width, width], -1)
    q = tf.reshape(q, [-1, num_heads, head_dim])
    k = tf.reshape(k, [-1, num_kv_heads, head_dim])
    if q_norm is not None:  # QK-norm: each head RMS-normed, before RoPE
        q, k = layer_norm_fallback(q, q_norm, eps=eps), layer_norm_fallback(k, k_norm, eps=eps)
    if rotary is not None:
        cos, sin = (t[:, None, :] for t in rotary)                     # [N, 1, R]
        turned = cos.shape[-1]

        def rotate(x):                                                  # [N, heads, Dh]
            if turned is not None and turned < x.shape[-1]:  # a partial rotary
                x, passed = tf.split(x, [turned, x.shape[-1] - turned], axis=-1)
                return tf.concat([rotate(x), passed], axis=-1)
            x1, x2 = tf.split(x, 2, axis=-1)
            return x * cos + tf.concat([-x2, x1], axis=-1) * sin

        q, k = rotate(q), rotate(k)
    return q, tf.reshape(k, [-1, width]), v


def is_compiled() -> bool:
    """True when the compiled op is loaded and not forced off."""
    return LIBRARY.is_compiled()


def kernel_status() -> str:
    """One line: which path the dense functions take here, and why (builds the op if needed)."""
    return LIBRARY.status()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
