"""Transformer building blocks, in the order a paper would present them.

Weights are stored in the layout Hugging Face checkpoints use after transposing to [in, out],
with q/k/v fused into one kernel and SwiGLU's gate and up projections fused into one, so a
batch-1 decode step reads each weight matrix with one matmul.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import keras
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.kernels.gguf_types import layer_format, parse_spec, row_bytes
from tokenserve.model.gguf_linear import blocks_entries, gguf_linear, gguf_parts
# RoPE lives in rotary.py; its names stay importable from here, where callers found them
from tokenserve.model.rotary import apply_rope, layer_rope_angles, rope_angles  # noqa: F401

_INIT_STD = 0.02  # GPT-2 / Llama initializer range
_RESTORING = contextvars.ContextVar("restoring_weights", default=False)


@contextlib.contextmanager
def restoring_weights():
    """Models built inside start with zeros, not normal samples: their weights are about to be
    restored, and drawing GPT-2-small's 124M samples took 2 s of a 4 s load on a 2-core VM."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def _normal(std: float = _INIT_STD):
    if _RESTORING.get():
        return "zeros"
    return keras.initializers.RandomNormal(stddev=std)


class Norm(keras.layers.Layer):
    """LayerNorm (GPT-2) or RMSNorm (Llama), computed in float32."""

    def __init__(self, kind: str, eps: float, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.eps = kind, eps

    def build(self, input_shape):
        dim = input_shape[-1]
        self.scale = self.add_weight(name="scale", shape=(dim,), initializer="ones")
        if self.kind == "layernorm":
            self.bias = self.add_weight(name="bias", shape=(dim,), initializer="zeros")

    def call(self, x):
        return norm(x, self.weights_dict(), self.kind, self.eps)

    def weights_dict(self) -> dict:
        """This layer's variables by role, for `norm` (the engine passes them explicitly)."""
        found = {"scale": self.scale.value}
        if self.kind == "layernorm":
            found["bias"] = self.bias.value
        return found


def norm(x, weights: dict, kind: str, eps: float):
    """LayerNorm (weights scale, bias) or RMSNorm (scale), computed in float32."""
    x32 = tf.cast(x, tf.float32)
    scale = tf.cast(weights["scale"], tf.float32)
    if kind == "layernorm":
        mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
        y = (x32 - mean) * tf.math.rsqrt(var + eps) * scale + tf.cast(weights["bias"], tf.float32)
    else:
        y = x32 * tf.math.rsqrt(tf.reduce_mean(tf.square(x32), -1, keepdims=True) + eps)
        y = y * scale
    return tf.cast(y, x.dtype)


def linear(x, weights: dict):
    """x @ kernel (+ bias). Float weights: kernel [in, out]. int8 weights: q [out, in] with
    scale [out, 1], through tokenserve's int8 matmul (which never rebuilds float weights)."""
    if "q" in weights:
        y = int8_linear(x, weights["q"], weights["scale"])
    elif parts := gguf_parts(weights):  # GGUF blocks as the file stores them
        y = gguf_linear(x, parts, portable=_portable.get())
    else:
        y = tf.matmul(x, tf.cast(weights["kernel"], x.dtype))
    if "lora" in weights:  # a full pass with an adapter (lora_factors): + (x @ A) @ B
        a, b = weights["lora"]
        y = y + tf.cast(tf.matmul(tf.matmul(tf.cast(x, tf.float32), a), b), y.dtype)
    return y + tf.cast(weights["bias"], x.dtype) if "bias" in weights else y


_portable = contextvars.ContextVar("tokenserve_portable_graphs", default=False)
_lora_factors = contextvars.ContextVar("tokenserve_lora_factors", default=None)


@contextlib.contextmanager
def lora_factors(factors: dict):
    """Inside, each Dense layer named in `factors` (id(layer) -> (A [in, r], B [r, out])
    float32) adds each row's (x @ A) @ B to its product: a full forward pass of the model
    with a LoRA adapter, on this thread only (prompt logprobs on an adapter). The engine's
    steps take their weights once, outside, and never see it."""
    token = _lora_factors.set(factors)
    try:
        yield
    finally:
        _lora_factors.reset(token)


@contextlib.contextmanager
def portable_graphs():
    """Graphs traced inside use only stock TensorFlow ops.

    A SavedModel must load in plain TensorFlow and stock TF Serving, which lack tokenserve's
    compiled int8 op: exports trace int8 layers with the pure-TF dequantize-and-matmul."""
    token = _portable.set(True)
    try:
        yield
    finally:
        _portable.reset(token)


def int8_linear(x, q, scale):
    """x [..., in] @ dequant(q [out, in], scale [out, G]).T -> [..., out] in x's dtype."""
    from tokenserve.kernels.int8_matmul import int8_matmul, int8_matmul_fallback

    width = tf.shape(q)[0]
    rows = tf.reshape(x, [-1, tf.shape(x)[-1]])
    if _portable.get():
        y = tf.cast(int8_matmul_fallback(tf.cast(rows, tf.float32), q, scale), x.dtype)
    else:
        y = int8_matmul(rows, q, scale)
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [width]], 0))


def mlp(x, up: dict, down: dict, kind: str):
    """GPT-2's GELU MLP, Llama's SwiGLU or Gemma's GeGLU (gate and up fused in one kernel)."""
    h = linear(x, up)
    if kind == "swiglu":
        gate, h = tf.split(h, 2, axis=-1)
        h = tf.nn.silu(gate) * h
    elif kind == "geglu":
        gate, h = tf.split(h, 2, axis=-1)
        h = tf.nn.gelu(gate, approximate=True) * h
    else:
        h = tf.nn.gelu(h, approximate=True)
    return linear(h, down)


def soft_cap(x, cap: float):
    """cap * tanh(x / cap) (Gemma 2's scores and logits); x unchanged for cap 0."""
    return cap * tf.tanh(x / cap) if cap else x


def visible(key, query, window: int):
    """Whether key position `key` is visible to a query at `query` (broadcast): causal, and
    within the last `window` positions when window > 0 (a sliding-window layer)."""
    causal = key <= query
    return causal & (key > query - window) if window else causal


def head_norm(x, weights: dict, eps: float):
    """QK-norm of x [..., H, Dh]: per head (scale [Dh]) or over all heads (scale [H * Dh])."""
    width = weights["scale"].shape[-1]  # (no walrus here: AutoGraph cannot convert one)
    if width == x.shape[-1]:
        return norm(x, weights, "rmsnorm", eps)
    return tf.reshape(norm(tf.reshape(x, [-1, width]), weights, "rmsnorm", eps), tf.shape(x))


def attend(q, k, v, mask, scale: float | None = None, softcap: float = 0.0):
    """Grouped-query scaled dot-product attention.

    q: [B, T, H, Dh]; k, v: [B, S, Hkv, Dh]; mask: bool [B, T, S]; scale: of the scores
    (default 1 / sqrt(Dh)); softcap: soft_cap's, on the scaled scores.
    Returns [B, T, H * Dh].
    """
    batch, num_q = tf.shape(q)[0], tf.shape(q)[1]
    num_heads, head_dim, num_kv = q.shape[2], q.shape[3], k.shape[2]
    q = tf.reshape(q, [batch, num_q, num_kv, num_heads // num_kv, head_dim])
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = tf.einsum("btkgd,bskd->bkgts", q, k) * scale
    scores = soft_cap(tf.cast(scores, tf.float32), softcap)
    scores = tf.where(mask[:, None, None, :, :], scores, tf.float32.min)
    probs = tf.cast(tf.nn.softmax(scores, axis=-1), v.dtype)
    out = tf.einsum("bkgts,bskd->btkgd", probs, v)
    return tf.reshape(out, [batch, num_q, num_heads * head_dim])


class Dense(keras.layers.Layer):
    """x @ kernel (+ bias); kernel is [in, out], or int8 q [out, in] with a float32 scale per
    output channel when weight_format is int8, or, when weight_format is a GGUF blocks spec
    (kernels/gguf_types.py), uint8 rows of blocks [rows, K / block values * block bytes] per
    part, as the file stores them."""

    def __init__(self, units: int, use_bias: bool, std: float = _INIT_STD,
                 weight_format: str = "float", **kwargs):
        super().__init__(**kwargs)
        self.units, self.use_bias, self.std = units, use_bias, std
        self.weight_format = weight_format

    def build(self, input_shape):
        if self.weight_format == "int8":
            self.kernel_q = self.add_weight(name="kernel_q", shape=(self.units, input_shape[-1]),
                                            dtype="int8", initializer="zeros", trainable=False)
            self.kernel_scale = self.add_weight(name="kernel_scale", shape=(self.units, 1),
                                                dtype="float32", initializer="ones",
                                                trainable=False)
        elif self.weight_format != "float":  # GGUF blocks: one uint8 variable per part
            parts = parse_spec(self.weight_format, self.units)
            self.block_types = [name for name, _ in parts]
            self.kernel_blocks = [
                self.add_weight(name="kernel_blocks" if len(parts) == 1 else f"kernel_blocks_{i}",
                                shape=(rows, row_bytes(name, input_shape[-1])), dtype="uint8",
                                initializer="zeros", trainable=False)
                for i, (name, rows) in enumerate(parts)]
        else:
            self.kernel = self.add_weight(name="kernel", shape=(input_shape[-1], self.units),
                                          initializer=_normal(self.std))
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, x):
        return linear(x, self.weights_dict())

    def weights_dict(self) -> dict:
        """This layer's variables by role, for `linear` (the engine passes them explicitly)."""
        if self.weight_format == "int8":
            found = {"q": self.kernel_q.value, "scale": self.kernel_scale.value}
        elif self.weight_format != "float":
            found = blocks_entries(self.block_types, [v.value for v in self.kernel_blocks])
        else:
            found = {"kernel": self.kernel.value}
        if self.use_bias:
            found["bias"] = self.bias.value
        factors = _lora_factors.get()
        if factors and id(self) in factors:
            found["lora"] = factors[id(self)]
        return found


class Attention(keras.layers.Layer):
    """Multi-head / grouped-query self-attention with an optional KV cache."""

    def __init__(self, config: TransformerConfig, layer: int = 0, formats: dict | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.config, self.layer = config, layer
        c = config
        formats = formats or {}  # role -> weight_format (a GGUF import's differ by layer)
        self.qkv = Dense((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.qkv_bias,
                         weight_format=formats.get("qkv", c.weight_format), name="qkv")
        out_std = _INIT_STD / math.sqrt(2 * c.num_layers)  # GPT-2's scaled residual init
        self.out = Dense(c.hidden_size, c.out_bias, std=out_std,
                         weight_format=formats.get("out", c.weight_format), name="out")
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            self.q_norm = Norm("rmsnorm", c.norm_eps, name="q_norm")
            self.k_norm = Norm("rmsnorm", c.norm_eps, name="k_norm")

    def build_norms(self):
        """QK-norm's scales, config.qk_norm_widths (Block.build builds the rest)."""
        if self.q_norm is not None:
            self.q_norm.build((None, self.config.qk_norm_widths[0]))
            self.k_norm.build((None, self.config.qk_norm_widths[1]))

    def _project(self, x, positions):
        c = self.config
        batch, length = tf.shape(x)[0], tf.shape(x)[1]
        qkv = self.qkv(x)
        q, k, v = tf.split(qkv, [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                 c.num_kv_heads * c.head_dim], axis=-1)
        q = tf.reshape(q, [batch, length, c.num_heads, c.head_dim])
        k = tf.reshape(k, [batch, length, c.num_kv_heads, c.head_dim])
        v = tf.reshape(v, [batch, length, c.num_kv_heads, c.head_dim])
        if self.q_norm is not None:
            q = head_norm(q, self.q_norm.weights_dict(), c.norm_eps)
            k = head_norm(k, self.k_norm.weights_dict(), c.norm_eps)
        if c.position == "rope":
            cos, sin = layer_rope_angles(c, self.layer, positions, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def _attend(self, q, k, v, mask):
        c = self.config
        return attend(q, k, v, mask, c.score_scale, c.attn_softcap)

    def call(self, x, positions, mask):
        """Full forward: x [B, T, D] attends to itself under `mask` [B, T, T]."""
        q, k, v = self._project(x, positions)
        return self.out(self._attend(q, k, v, mask))

    def call_cached(self, x, positions, mask, cache):
        """Writes this chunk's K/V into `cache` and attends over the whole cache.

        cache: [2, B, L, Hkv, Dh] (this layer's); positions: [B, T]; mask: [B, T, L].
        The write is a scatter of B*T rows, so its cost grows with new tokens;
        the rows must be in range (positions < L), which callers guarantee.
        """
        q, k, v = self._project(x, positions)
        batch, length = tf.shape(x)[0], tf.shape(x)[1]
        rows = tf.broadcast_to(tf.range(batch)[:, None], [batch, length])
        index = tf.stack([tf.zeros_like(rows), rows, positions], axis=-1)  # [B, T, 3]
        index = tf.concat([index, index + tf.constant([1, 0, 0])], axis=0)  # k rows, then v rows
        cache = tf.tensor_scatter_nd_update(cache, index,
                                            tf.cast(tf.concat([k, v], axis=0), cache.dtype))
        keys, values = tf.cast(cache[0], q.dtype), tf.cast(cache[1], q.dtype)  # [B, L, Hkv, Dh]
        return self.out(self._attend(q, keys, values, mask)), cache


class MLP(keras.layers.Layer):
    """GPT-2's GELU MLP or Llama's SwiGLU."""

    def __init__(self, config: TransformerConfig, formats: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        c = config
        self.kind = c.mlp
        formats = formats or {}  # role -> weight_format, as Attention's
        width = c.intermediate_size if c.mlp == "gelu" else 2 * c.intermediate_size
        self.up = Dense(width, c.mlp_bias, weight_format=formats.get("up", c.weight_format),
                        name="up")
        self.down = Dense(c.hidden_size, c.mlp_bias, std=_INIT_STD / math.sqrt(2 * c.num_layers),
                          weight_format=formats.get("down", c.weight_format), name="down")

    def call(self, x):
        return mlp(x, self.up.weights_dict(), self.down.weights_dict(), self.kind)


class Block(keras.layers.Layer):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with post_norms
    (Gemma) each branch's output is normed too before it is added."""

    def __init__(self, config: TransformerConfig, layer: int = 0, **kwargs):
        super().__init__(**kwargs)
        # each projection's weight format: the config's, or its GGUF file's blocks by layer
        formats = {role: layer_format(config, f"{self.name}/{role}")
                   for role in ("qkv", "out", "up", "down")}
        self.attn_norm = Norm(config.norm, config.norm_eps, name="attn_norm")
        self.attn = Attention(config, layer, formats, name="attn")
        self.mlp_norm = Norm(config.norm, config.norm_eps, name="mlp_norm")
        self.formats = formats
        self.mlp = self.make_mlp(config)
        self.post_attn_norm = self.post_mlp_norm = None
        if config.post_norms:
            self.post_attn_norm = Norm(config.norm, config.norm_eps, name="post_attn_norm")
            self.post_mlp_norm = Norm(config.norm, config.norm_eps, name="post_mlp_norm")

    def make_mlp(self, config: TransformerConfig):
        """The block's feed-forward layer (a mixture of experts overrides it: model/moe.py)."""
        return MLP(config, self.formats, name="mlp")

    def build(self, input_shape):
        self.attn_norm.build(input_shape)
        self.attn.qkv.build(input_shape)
        c = self.attn.config  # heads may be pruned: the attention width can be below hidden
        self.attn.out.build((*input_shape[:-1], c.num_heads * c.head_dim))
        self.attn.build_norms()
        self.mlp_norm.build(input_shape)
        self.build_mlp(input_shape)
        if self.post_attn_norm is not None:
            self.post_attn_norm.build(input_shape)
            self.post_mlp_norm.build(input_shape)

    def build_mlp(self, input_shape):
        self.mlp.up.build(input_shape)
        gated = self.mlp.kind != "gelu"  # up holds gate and up: twice the MLP's width
        self.mlp.down.build((None, None, self.mlp.up.units // (2 if gated else 1)))

    def _residual(self, x, h, post_norm):
        return x + (h if post_norm is None else post_norm(h))

    def mlp_weights(self) -> dict:
        """The feed-forward layer's variables by role, as the engine's step takes them."""
        return {"up": self.mlp.up.weights_dict(), "down": self.mlp.down.weights_dict()}

    def call(self, x, positions, mask):
        x = self._residual(x, self.attn(self.attn_norm(x), positions, mask), self.post_attn_norm)
        return self._residual(x, self.mlp(self.mlp_norm(x)), self.post_mlp_norm)

    def call_cached(self, x, positions, mask, cache):
        h, cache = self.attn.call_cached(self.attn_norm(x), positions, mask, cache)
        x = self._residual(x, h, self.post_attn_norm)
        return self._residual(x, self.mlp(self.mlp_norm(x)), self.post_mlp_norm), cache
