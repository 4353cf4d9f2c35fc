"""The fused float32 dense and norm ops (kernels/dense.cc): AVX2 and scalar paths against a
float64 NumPy reference, both weight layouts, every epilogue, graph mode, bad shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from support.finish_blocks import block_weights
from tokenserve.kernels import dense as kd

# (M, K, N): empty batch, one row, more rows than one pass over the weights (8), K and N not
# multiples of 4 or 8 (tails), GPT-2-small's MLP shape; one to eight rows with K long enough
# to be split between threads (an odd K: unequal parts) run the split-K path, and K = 140
# runs its passes of eight, four and one weight rows. From 9 rows
# AVX2 runs "kn" as packed chunks of 64 weight rows by up to 1,024 columns in register tiles
# of six rows by 16 columns: a K of several chunks and a short last one, an N of three
# column blocks with a short last panel, and row counts that leave one to five rows after
# the tiles of six; from 24 rows "nk" packs blocks of 64 weight rows transposed (K and N
# not multiples of 8 or 16: the zero-padded tails). Each thread owns a range of the packed
# chunks and takes the others' from the back when its own are done: one chunk (17, 33, 18)
# is fewer than the threads, three (12, 192, 40) split unequally.
CASES = [(0, 16, 8), (1, 64, 8), (3, 37, 21), (9, 100, 34), (17, 33, 18), (2, 768, 3072),
         (3, 300, 40), (4, 768, 259), (13, 768, 259), (53, 70, 35),
         (1, 131, 21), (2, 257, 13), (1, 768, 2304), (8, 200, 2100), (38, 130, 48),
         (32, 768, 2304), (5, 257, 37), (6, 768, 130), (7, 131, 300), (1, 140, 24), (3, 140, 24),
         (12, 192, 40)]


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(kd.LIBRARY)


def make(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
            rng.standard_normal(n).astype(np.float32))


def reference(x, w, bias, residual, activation):
    z = x.astype(np.float64) @ w.astype(np.float64) + bias
    if activation == "gelu_tanh":
        z = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    elif activation == "swiglu":
        gate, up = np.split(z, 2, axis=-1)
        z = gate / (1 + np.exp(-gate)) * up
    elif activation == "geglu":
        gate, up = np.split(z, 2, axis=-1)
        z = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    return z if residual is None else z + residual


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("activation", ["none", "gelu_tanh", "swiglu", "geglu"])
@pytest.mark.parametrize("m,k,n", CASES)
def test_dense_matches_reference(compiled, m, k, n, activation, layout, isa):
    if activation in kd.GATED and n % 2:
        n += 1
    x, w, bias = make(m, k, n)
    out = n // 2 if activation in kd.GATED else n
    residual = np.random.default_rng(1).standard_normal((m, out)).astype(np.float32)
    want = reference(x, w, bias, residual, activation)
    weights = w if layout == "kn" else np.ascontiguousarray(w.T)
    got = kd.dense(x, weights, bias, residual, layout, activation, isa=isa).numpy()
    assert got.shape == (m, out)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # without bias and residual (the tied LM head's case)
    plain = kd.dense(x, weights, layout=layout, isa=isa).numpy()
    np.testing.assert_allclose(plain, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("layernorm", [True, False])
def test_norm_matches_reference(compiled, isa, layernorm):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 77)) * 3 + 1).astype(np.float32)
    scale, bias = rng.standard_normal(77).astype(np.float32), rng.standard_normal(77).astype(np.float32)
    x64 = x.astype(np.float64)
    if layernorm:
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
        want = want * scale + bias
    else:
        want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    got = kd.layer_norm(x, scale, bias if layernorm else None, 1e-5, isa=isa).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    fallback = kd.layer_norm_fallback(x, scale, bias if layernorm else None, 1e-5).numpy()
    np.testing.assert_allclose(fallback, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["none", "gelu_tanh", "swiglu", "geglu"])
@pytest.mark.parametrize("m", [1, 40])
def test_epilogue_matches_reference(compiled, activation, m):
    rng = np.random.default_rng(3)
    z = rng.standard_normal((m, 36)).astype(np.float32)
    bias = rng.standard_normal(36).astype(np.float32)
    out = 18 if activation in kd.GATED else 36
    residual = rng.standard_normal((m, out)).astype(np.float32)
    eye = np.eye(36, dtype=np.float32)  # z @ I: the reference's matmul is the identity
    want = reference(z, eye, bias, residual, activation)
    for isa in ("auto", "scalar"):
        got = kd.epilogue(z, bias, residual, activation, isa=isa).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kd.epilogue_fallback(z, bias, residual, activation).numpy(), want,
                               rtol=1e-5, atol=1e-5)


def test_the_fallback_matches_the_op(compiled):
    x, w, bias = make(3, 40, 24)
    for activation in ("none", "gelu_tanh", "swiglu", "geglu"):
        np.testing.assert_allclose(kd.dense(x, w, bias, activation=activation).numpy(),
                                   kd.dense_fallback(x, w, bias, activation=activation).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_in_a_graph_with_unknown_batch(compiled):
    x, w, bias = make(4, 32, 16)

    @tf.function(input_signature=[tf.TensorSpec([None, 32], tf.float32)])
    def layer(x):
        return kd.dense(x, w, bias, activation="swiglu")

    assert layer.get_concrete_function().structured_outputs.shape.as_list() == [None, 8]
    np.testing.assert_allclose(layer(x).numpy(), reference(x, w, bias, None, "swiglu"),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args,message", [
    (dict(w=np.zeros((31, 8), np.float32)), "expected \\[K, N\\]"),
    (dict(bias=np.zeros(7, np.float32)), "bias must be"),
    (dict(residual=np.zeros((4, 9), np.float32)), "residual must be"),
    (dict(w=np.zeros((32, 7), np.float32), activation="swiglu"), "even N"),
])
def test_bad_shapes_are_invalid_argument(compiled, args, message):
    call = dict(x=np.zeros((4, 32), np.float32), w=np.zeros((32, 8), np.float32))
    call.update(args)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        kd.dense(**call)


def test_forced_fallback(monkeypatch):
    monkeypatch.setenv("TOKENSERVE_DENSE_KERNEL", "fallback")
    assert not kd.is_compiled()
    assert kd.kernel_status() == "pure-TF fallback: TOKENSERVE_DENSE_KERNEL=fallback"
    x, w, bias = make(2, 16, 8)
    np.testing.assert_allclose(kd.dense(x, w, bias, activation="gelu_tanh").numpy(),
                               reference(x, w, bias, None, "gelu_tanh"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("activation,norm_bias,m,d,f", [
    ("gelu_tanh", True, 1, 64, 256),    # GPT-2: LayerNorm, biases, one decode row (split K)
    ("gelu_tanh", True, 6, 96, 200),    # K too short to split, widths not x 32
    ("gelu_tanh", True, 7, 256, 520),   # split K at 7 rows
    ("swiglu", False, 3, 64, 256),      # Llama: RMSNorm, no biases
    ("swiglu", False, 1, 40, 344),      # widths not a multiple of 8 (scalar tails)
    ("swiglu", False, 20, 72, 2200),    # packed chunks; the gate and up halves in 3 blocks
    ("geglu", False, 3, 64, 256),       # Gemma: RMSNorm, no biases, tanh-GELU gate
    ("geglu", False, 20, 72, 2200)])
def test_finish_block_equals_the_separate_ops(compiled, isa, activation, norm_bias, m, d, f):
    """The fused block runs the separate ops' kernels in the same order. Split K sums each
    thread's share in the order threads took them, so two calls of one op already differ in
    the last bits: close to float rounding, not bit for bit."""
    out, norm, up, down = block_weights(d, f, activation, norm_bias, seed=m + d)
    rng = np.random.default_rng(1)
    attn = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32) * 3)
    fused = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-5, isa=isa).numpy()

    x1 = kd.dense(attn, out["kernel"], out.get("bias"), x, isa=isa)
    h = kd.layer_norm(x1, norm["scale"], norm.get("bias"), 1e-5, isa=isa)
    u = kd.dense(h, up["kernel"], up.get("bias"), activation=activation, isa=isa)
    separate = kd.dense(u, down["kernel"], down.get("bias"), x1, isa=isa).numpy()
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)
    # with the next block's norm and QKV projection in the same op
    _, next_norm, next_qkv, _ = block_weights(d, 3 * d, activation, norm_bias, seed=7)
    y, following = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-5, isa=isa,
                                   next_norm=next_norm, next_qkv=next_qkv)
    np.testing.assert_allclose(y.numpy(), fused, rtol=1e-5, atol=1e-5)
    h = kd.layer_norm(y, next_norm["scale"], next_norm.get("bias"), 1e-5, isa=isa)
    np.testing.assert_allclose(following.numpy(), kd.dense(
        h, next_qkv["kernel"], next_qkv.get("bias"), isa=isa).numpy(), rtol=1e-5, atol=1e-5)

    # and it is the block's math, in float64
    x1 = attn.numpy() @ out["kernel"].numpy().astype(np.float64) + x.numpy()
    x1 = x1 + (out["bias"].numpy() if "bias" in out else 0)
    mean = x1.mean(-1, keepdims=True) if norm_bias else 0
    var = ((x1 - mean) ** 2).mean(-1, keepdims=True)
    h = (x1 - mean) / np.sqrt(var + 1e-5) * norm["scale"].numpy() + (
        norm["bias"].numpy() if norm_bias else 0)
    u = reference(h, up["kernel"].numpy(), up["bias"].numpy() if "bias" in up else 0, None,
                  activation)
    expected = reference(u, down["kernel"].numpy(),
                         down["bias"].numpy() if "bias" in down else 0, x1, "none")
    np.testing.assert_allclose(fused, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("activation,m,d,f", [("geglu", 1, 64, 256), ("geglu", 5, 40, 344),
                                              ("swiglu", 20, 72, 2200)])
def test_finish_block_with_post_norms_equals_the_separate_ops(compiled, isa, activation, m, d,
                                                              f):
    """Gemma's post-norms: each branch's output RMS-normed before its residual add, in the
    one op, as the separate ops and the block's float64 math compute it."""
    out, norm, up, down = block_weights(d, f, activation, False, seed=m + d)
    rng = np.random.default_rng(2)
    post_attn, post_mlp = ({"scale": tf.constant(1 + 0.3 * rng.standard_normal(d).astype(
        np.float32))} for _ in range(2))
    attn = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32) * 3)
    fused = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-6, isa=isa,
                            post_attn_norm=post_attn, post_mlp_norm=post_mlp).numpy()
    x1 = x + kd.layer_norm(kd.dense(attn, out["kernel"], isa=isa), post_attn["scale"],
                           eps=1e-6, isa=isa)
    h = kd.layer_norm(x1, norm["scale"], eps=1e-6, isa=isa)
    u = kd.dense(h, up["kernel"], activation=activation, isa=isa)
    separate = x1 + kd.layer_norm(kd.dense(u, down["kernel"], isa=isa), post_mlp["scale"],
                                  eps=1e-6, isa=isa)
    np.testing.assert_allclose(fused, separate.numpy(), rtol=1e-5, atol=1e-5)
    # with the next block's norm and QKV: the same y
    _, next_norm, next_qkv, _ = block_weights(d, 3 * d, activation, False, seed=7)
    y, _ = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-6, isa=isa,
                           next_norm=next_norm, next_qkv=next_qkv, post_attn_norm=post_attn,
                           post_mlp_norm=post_mlp)
    np.testing.assert_allclose(y.numpy(), fused, rtol=1e-5, atol=1e-5)

    def rms(v, scale):
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + 1e-6) * scale["scale"].numpy()

    x1 = x.numpy() + rms(attn.numpy() @ out["kernel"].numpy().astype(np.float64), post_attn)
    u = reference(rms(x1, norm), up["kernel"].numpy(), 0, None, activation)
    expected = x1 + rms(u @ down["kernel"].numpy().astype(np.float64), post_mlp)
    np.testing.assert_allclose(fused, expected, rtol=1e-4, atol=1e-4)
    # without post-norms the result differs: the scales are really read
    plain = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-6, isa=isa).numpy()
    assert not np.allclose(plain, fused, atol=1e-2)


def test_finish_block_refuses_weights_that_do_not_fit(compiled):
    out, norm, up, down = block_weights(64, 256, "gelu_tanh", True, seed=0)
    attn = x = tf.zeros([2, 64])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"down_w must be \[256, 64\]"):
        kd.finish_block(attn, x, out, norm, up, {**down, "kernel": down["kernel"][:128]})
    with pytest.raises(tf.errors.InvalidArgumentError, match="attn and x must be"):
        kd.finish_block(attn, tf.zeros([3, 64]), out, norm, up, down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="norm_bias must be"):
        kd.finish_block(attn, x, out, {**norm, "bias": tf.zeros([63])}, up, down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="swiglu needs an even up width"):
        kd.finish_block(attn, x, out, norm, {"kernel": tf.zeros([64, 255])}, down, "swiglu")
    with pytest.raises(ValueError, match="activation must be"):
        kd.finish_block(attn, x, out, norm, up, down, "relu")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="post_attn_scale and post_mlp_scale must both be"):
        kd.finish_block(attn, x, out, norm, up, down, post_attn_norm={"scale": tf.ones([64])},
                        post_mlp_norm={"scale": tf.ones([63])})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"next_w must be \[D, Nq\]"):
        kd.finish_block(attn, x, out, norm, up, down, next_norm=norm, next_qkv=down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_bias must be"):
        kd.finish_block(attn, x, out, norm, up, down, next_norm=norm,
                        next_qkv={"kernel": up["kernel"], "bias": tf.zeros([5])})
    qkv = {"kernel": tf.zeros([64, 192])}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"next_norm_scale must be \[64\]"):
        kd.finish_block(attn, x, out, norm, up, down, next_norm={"scale": tf.zeros([3])},
                        next_qkv=qkv)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_norm_bias must be"):
        kd.finish_block(attn, x, out, norm, up, down,
                        next_norm={**norm, "bias": tf.zeros([63])}, next_qkv=qkv)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_bias need next_w"):
        kd.finish_block(attn, x, out, norm, up, down, next_norm=norm,
                        next_qkv={"kernel": tf.zeros([0, 0])})


def _to_bf16(w: np.ndarray) -> tuple[tf.Tensor, np.ndarray]:
    """w rounded to bfloat16 by TF, and the float32 values the rounded weights stand for."""
    rounded = tf.cast(tf.constant(w), tf.bfloat16)
    return rounded, tf.cast(rounded, tf.float32).numpy()


# bfloat16 weights take the same work splits: one row (split K), a few rows with tails,
# packed chunks from 9 rows ("kn") and transposed panels from 24 ("nk")
BF16_CASES = [(1, 64, 8), (3, 37, 21), (1, 768, 2304), (5, 257, 37), (8, 200, 2100),
              (13, 768, 259), (32, 130, 48)]


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m,k,n", BF16_CASES)
def test_bfloat16_weights_are_widened_exactly(compiled, m, k, n, layout, isa):
    """bfloat16 weights give float32 x @ W of the rounded weights: the op widens each weight
    exactly (its bits are a float32's upper half) and multiplies in float32. A kernel that
    read the 16-bit words as anything else would be far off."""
    x, w, bias = make(m, k, n, seed=k + n)
    rounded, widened = _to_bf16(w if layout == "kn" else np.ascontiguousarray(w.T))
    want_w = widened if layout == "kn" else widened.T
    residual = np.random.default_rng(2).standard_normal((m, n)).astype(np.float32)
    got = kd.dense(x, rounded, bias, residual, layout, "gelu_tanh", isa=isa).numpy()
    np.testing.assert_allclose(got, reference(x, want_w, bias, residual, "gelu_tanh"),
                               rtol=1e-4, atol=1e-4)
    assert np.abs(widened - (w if layout == "kn" else w.T)).max() > 0  # the rounding is real
    # the stock-TF fallback computes the same
    np.testing.assert_allclose(kd.dense_fallback(x, rounded, bias, residual, layout,
                                                 "gelu_tanh").numpy(), got, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("activation,m", [("gelu_tanh", 1), ("swiglu", 3), ("gelu_tanh", 20)])
def test_finish_block_with_bfloat16_weights(compiled, activation, m):
    """The fused block with bfloat16 matrices equals the block with those weights widened to
    float32 (biases and norms stay float32), the next block's QKV included."""
    d, f = 64, 256
    out, norm, up, down = block_weights(d, f, activation, activation == "gelu_tanh", seed=m)
    _, next_norm, next_qkv, _ = block_weights(d, 3 * d, activation, True, seed=9)

    def split(w):
        rounded, widened = _to_bf16(w["kernel"].numpy())
        return {**w, "kernel": rounded}, {**w, "kernel": tf.constant(widened)}

    (out16, out32), (up16, up32), (down16, down32), (qkv16, qkv32) = map(
        split, (out, up, down, next_qkv))
    rng = np.random.default_rng(3)
    attn = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    y16, next16 = kd.finish_block(attn, x, out16, norm, up16, down16, activation,
                                  next_norm=next_norm, next_qkv=qkv16)
    y32, next32 = kd.finish_block(attn, x, out32, norm, up32, down32, activation,
                                  next_norm=next_norm, next_qkv=qkv32)
    np.testing.assert_allclose(y16.numpy(), y32.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(next16.numpy(), next32.numpy(), rtol=1e-5, atol=1e-5)
    alone = kd.finish_block(attn, x, out16, norm, up16, down16, activation)
    np.testing.assert_allclose(alone.numpy(), y32.numpy(), rtol=1e-5, atol=1e-5)
