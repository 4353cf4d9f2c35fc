"""The int8-weight matmul: quantization, the compiled op (AVX512-VNNI where the CPU has it,
AVX2 and scalar paths, int8 and float activations) and the pure-TF fallback against NumPy
references, graph mode, bad shapes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import int8_matmul as im

# (M, K, N, G): empty batch, decode sizes, K not a multiple of 32 (the built-in model's 688),
# groups shorter than a 32-block (100 / 5 = 20), exactly one block (768 / 24), N % 4 != 0.
CASES = [(0, 64, 8, 1), (1, 64, 8, 1), (1, 768, 36, 1), (7, 688, 13, 1), (33, 256, 9, 1),
         (5, 100, 10, 5), (3, 768, 17, 24), (8, 1536, 12, 12), (2, 40, 6, 1),
         # one or two rows (the AVX2 row kernel): groups, short blocks, blocks not in fours
         (1, 300, 5, 1), (2, 100, 10, 5), (1, 768, 17, 24), (2, 1536, 12, 12), (1, 200, 9, 2),
         # 3-8 rows (rows of x in fours, or five, against one weight row): every remainder of 4, with
         # short blocks and groups; and 9 rows, the tile kernel again
         (4, 40, 5, 1), (6, 300, 7, 1), (6, 200, 9, 2), (3, 100, 3, 5), (9, 64, 8, 1),
         (5, 300, 7, 1), (5, 768, 6, 24),  # five rows: one group
         # 16 rows and more (a step of 16-48 sequences), channels not in fours, short
         # blocks, groups
         (16, 768, 21, 1), (16, 40, 6, 1), (17, 688, 13, 1), (31, 100, 10, 5),
         (32, 768, 17, 24), (48, 1536, 12, 12), (40, 200, 9, 2)]


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(im.LIBRARY)


def make(m, k, n, g, seed=0):
    """x [M, K] float32, q [N, K] int8, scale [N, G] float32, with outliers in x (as LLM
    activations have) so that per-block activation scales matter."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if m and k:
        x[:, rng.integers(0, k, 3)] *= 20
    q, scale = im.quantize_weight(rng.standard_normal((k, n)).astype(np.float32), k // g)
    return x, q, scale


def reference(x, q, scale):
    """Exact x @ dequant(q, scale).T in float64."""
    return x.astype(np.float64) @ im.dequantize_weight(q, scale).astype(np.float64).T


def reference_int8_activations(x, q, scale):
    """What the int8-activation kernel computes: x quantized per 32-block (blocks restart at
    each weight group; a short last block is zero-padded), integer dot products per block."""
    m, k = x.shape
    n, g = scale.shape
    group = k // g
    y = np.zeros((m, n))
    for start in range(0, k, group):
        for b in range(start, start + group, 32):
            xb = x[:, b:min(b + 32, start + group)]
            amax = np.abs(xb).max(axis=1, initial=0).astype(np.float32)
            inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
            xq = np.rint(xb * inv.astype(np.float32)[:, None])  # float32 product, half-even
            dots = xq.astype(np.int64) @ q[:, b:b + xb.shape[1]].astype(np.int64).T
            y += dots * (amax / np.float32(127)).astype(np.float64)[:, None] \
                * scale[:, start // group].astype(np.float64)
    return y


def relative_error(y, ref):
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


# --------------------------------------------------------------------------------------------
# quantize_weight


@pytest.mark.parametrize("group_size", [None, 32, 48])
def test_quantize_round_trip(group_size):
    rng = np.random.default_rng(1)
    kernel = rng.standard_normal((96, 10)).astype(np.float32)
    kernel[:, 3] = 0.0  # an all-zero output channel
    q, scale = im.quantize_weight(kernel, group_size)
    groups = 1 if group_size is None else 96 // group_size
    assert q.shape == (10, 96) and q.dtype == np.int8 and q.flags["C_CONTIGUOUS"]
    assert scale.shape == (10, groups) and scale.dtype == np.float32
    assert np.abs(q).max() <= 127 and np.all(np.isfinite(scale)) and np.all(scale > 0)
    assert not q[3].any()
    error = np.abs(im.dequantize_weight(q, scale) - kernel.T)
    bound = np.repeat(scale, 96 // groups, axis=1) / 2
    assert np.all(error <= bound * (1 + 1e-5))
    # absmax maps to +-127 in every non-zero row or group
    assert np.all(np.abs(q.reshape(10, groups, -1)).max(axis=2)[np.arange(10) != 3] == 127)


def test_quantize_rejects_group_size_not_dividing_k():
    with pytest.raises(ValueError, match="divide"):
        im.quantize_weight(np.ones((96, 4), np.float32), 40)


# --------------------------------------------------------------------------------------------
# The compiled op


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("m,k,n,g", CASES)
def test_compiled_int8_activations(compiled, m, k, n, g, isa):
    x, q, scale = make(m, k, n, g)
    y = im.compiled_int8_matmul(x, q, scale, activations="int8", isa=isa).numpy()
    assert y.shape == (m, n) and y.dtype == np.float32
    if m == 0:
        return
    # Tight: the kernel's own arithmetic (it differs only in float summation order).
    emulated = reference_int8_activations(x, q, scale)
    assert relative_error(y, emulated) < 2e-6
    # Loose: against exact math, activation quantization costs up to 1/254 of a block's
    # absmax per value: ~1% here, where a few 20x outliers coarsen their blocks; a wrong
    # scale or a block mix-up is off by O(1).
    assert relative_error(y, reference(x, q, scale)) < 3e-2


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("m,k,n,g", CASES)
def test_compiled_float_activations(compiled, m, k, n, g, isa):
    x, q, scale = make(m, k, n, g)
    y = im.compiled_int8_matmul(x, q, scale, activations="float", isa=isa).numpy()
    assert y.shape == (m, n)
    if m:
        assert relative_error(y, reference(x, q, scale)) < 1e-6


def test_int8_matmul_uses_the_compiled_op(compiled, monkeypatch):
    monkeypatch.delenv(im.MODE_ENV, raising=False)
    assert im.kernel_status().startswith("compiled int8 matmul op")
    x, q, scale = make(4, 256, 12, 1)
    y = im.int8_matmul(x, q, scale).numpy()
    np.testing.assert_allclose(y, reference_int8_activations(x, q, scale), rtol=1e-4, atol=1e-4)


def test_compiled_graph_mode_does_not_retrace(compiled, monkeypatch):
    monkeypatch.delenv(im.MODE_ENV, raising=False)
    spec = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None, None], tf.int8),
            tf.TensorSpec([None, None], tf.float32)]
    f = tf.function(im.int8_matmul, input_signature=spec)
    for m, k, n, g in [(3, 128, 8, 1), (9, 96, 5, 3)]:
        x, q, scale = make(m, k, n, g)
        assert relative_error(f(x, q, scale).numpy(), reference(x, q, scale)) < 3e-2
    assert f.experimental_get_tracing_count() == 1
    assert "TokenserveInt8Matmul" in {op.type for op in f.get_concrete_function().graph
                                      .get_operations()}


@pytest.mark.parametrize("shapes", [
    ((2, 64), (8, 32), (8, 1)),    # K differs between x and q
    ((2, 64), (8, 64), (7, 1)),    # N differs between q and scale
    ((2, 64), (8, 64), (8, 3)),    # G does not divide K
    ((2, 64), (8, 64), (8, 0)),    # no groups
    ((64,), (8, 64), (8, 1)),      # x not a matrix
])
def test_compiled_bad_shapes(compiled, shapes):
    x, q, scale = (np.zeros(s, dtype) for s, dtype in zip(shapes, (np.float32, np.int8,
                                                                   np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError):  # eager: the kernel's checks
        im.compiled_int8_matmul(x, q, scale)
    if len(shapes[0]) == 2:  # graph mode with unknown shapes: checked at run time too
        spec = [tf.TensorSpec([None, None], d) for d in (tf.float32, tf.int8, tf.float32)]
        f = tf.function(im.compiled_int8_matmul, input_signature=spec)
        with pytest.raises(tf.errors.InvalidArgumentError):
            f(x, q, scale)


def test_compiled_static_shape_inference(compiled):
    _, q, scale = make(0, 64, 8, 1)
    f = tf.function(lambda x: im.compiled_int8_matmul(x, q, scale))
    assert f.get_concrete_function(tf.TensorSpec([5, None])).output_shapes == [5, 8]


# --------------------------------------------------------------------------------------------
# The pure-TF fallback and dtype handling


@pytest.mark.parametrize("m,k,n,g", CASES)
def test_fallback_matches_reference(m, k, n, g, monkeypatch):
    monkeypatch.setenv(im.MODE_ENV, "fallback")
    assert im.kernel_status() == "pure-TF fallback: TOKENSERVE_INT8_KERNEL=fallback"
    x, q, scale = make(m, k, n, g)
    y = im.int8_matmul(x, q, scale).numpy()
    assert y.shape == (m, n)
    if m:
        assert relative_error(y, reference(x, q, scale)) < 1e-6


def test_fallback_graph_mode(monkeypatch):
    monkeypatch.setenv(im.MODE_ENV, "fallback")
    spec = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None, None], tf.int8),
            tf.TensorSpec([None, None], tf.float32)]
    f = tf.function(im.int8_matmul, input_signature=spec)
    for m, k, n, g in [(3, 128, 8, 1), (9, 96, 5, 3)]:
        x, q, scale = make(m, k, n, g)
        assert relative_error(f(x, q, scale).numpy(), reference(x, q, scale)) < 1e-6
    assert f.experimental_get_tracing_count() == 1
    assert "TokenserveInt8Matmul" not in {op.type for op in f.get_concrete_function().graph
                                          .get_operations()}


def test_missing_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.delenv(im.MODE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    monkeypatch.setattr(im.LIBRARY, "_loaded", None)  # a fresh process, as far as loading goes
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert im.kernel_status().startswith("pure-TF fallback: g++ not found")
    x, q, scale = make(2, 64, 4, 1)
    assert relative_error(im.int8_matmul(x, q, scale).numpy(), reference(x, q, scale)) < 1e-6


def test_failed_build_falls_back(monkeypatch, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    bad = tmp_path / "int8_matmul.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.delenv(im.MODE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(im.LIBRARY, "_loaded", None)
    monkeypatch.setattr(im.LIBRARY, "sources", (bad,))
    assert im.kernel_status().startswith("pure-TF fallback: compiling int8_matmul failed")
    assert list((tmp_path / "cache" / "tokenserve" / "kernels").iterdir()) == []  # no debris
    x, q, scale = make(2, 64, 4, 1)
    assert relative_error(im.int8_matmul(x, q, scale).numpy(), reference(x, q, scale)) < 1e-6


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_half_precision_x_is_cast(dtype):
    x, q, scale = make(3, 128, 8, 1)
    y = im.int8_matmul(tf.cast(x, dtype), q, scale)
    assert y.dtype == dtype
    assert relative_error(tf.cast(y, tf.float32).numpy(), reference(x, q, scale)) < 2e-2


def test_integer_x_is_rejected():
    with pytest.raises(TypeError, match="float32"):
        im.int8_matmul(np.ones((2, 64), np.int32), *make(0, 64, 4, 1)[1:])


@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
def test_compiled_non_finite_x_gives_nan(compiled, activations, isa):
    x, q, scale = make(3, 96, 8, 1)
    x[0, 5], x[1, 70] = np.nan, np.inf
    y = im.compiled_int8_matmul(x, q, scale, activations=activations, isa=isa).numpy()
    assert not np.isfinite(y[:2]).any()  # as in float math: not silently finite
    assert relative_error(y[2:], reference(x[2:], q, scale)) < 3e-2  # other rows unharmed


def _block_weights(d, f, activation, norm_bias, seed, group=None):
    """Random int8 weights of a block's second half: out [D, D], up [F, D], down [D, F or F/2]
    (biases for GPT-2-style blocks, none for Llama-style ones), and its MLP norm."""
    rng = np.random.default_rng(seed)
    biased = activation == "gelu_tanh"

    def layer(k, n):
        q, scale = im.quantize_weight(rng.standard_normal((k, n)).astype(np.float32) * 0.05,
                                      group)
        weights = {"q": tf.constant(q), "scale": tf.constant(scale)}
        if biased:
            weights["bias"] = tf.constant(rng.standard_normal(n).astype(np.float32) * 0.1)
        return weights

    inner = f // 2 if activation == "swiglu" else f
    norm = {"scale": tf.constant(rng.standard_normal(d).astype(np.float32))}
    if norm_bias:
        norm["bias"] = tf.constant(rng.standard_normal(d).astype(np.float32))
    return layer(d, d), norm, layer(d, f), layer(inner, d)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("activation,norm_bias,m,d,f,group", [
    ("gelu_tanh", True, 1, 64, 256, None),   # GPT-2: LayerNorm, biases, one scale per row
    ("gelu_tanh", True, 5, 96, 200, None),   # several rows, widths not a multiple of 32
    ("swiglu", False, 3, 64, 256, 32),       # Llama: RMSNorm, no biases, grouped scales
    ("swiglu", False, 1, 40, 344, None),     # widths not a multiple of 8 (scalar tails)
    ("gelu_tanh", True, 20, 96, 200, None),  # the rows of a step of many sequences
    ("swiglu", False, 32, 64, 256, 32)])
def test_finish_block_equals_the_separate_ops(compiled, isa, activation, norm_bias, m, d, f,
                                              group):
    """The fused block is the separate int8 matmuls, epilogues and norm, bit for bit: the same
    kernels (rowops.h is shared with the dense library) in the same order."""
    from tokenserve.kernels import dense as kdense

    if not kdense.is_compiled():
        pytest.skip("the dense library (epilogue, norm) is not compiled here")
    out, norm, up, down = _block_weights(d, f, activation, norm_bias, seed=m + d, group=group)
    rng = np.random.default_rng(1)
    attn = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32) * 3)
    fused = im.int8_finish_block(attn, x, out, norm, up, down, activation, 1e-5, isa=isa)

    def matmul(a, w):
        return im.compiled_int8_matmul(a, w["q"], w["scale"], isa=isa)

    x1 = kdense.epilogue(matmul(attn, out), out.get("bias"), x, isa=isa)
    h = kdense.layer_norm(x1, norm["scale"], norm.get("bias"), 1e-5, isa=isa)
    u = kdense.epilogue(matmul(h, up), up.get("bias"), None, activation, isa=isa)
    separate = kdense.epilogue(matmul(u, down), down.get("bias"), x1, isa=isa)
    np.testing.assert_array_equal(fused.numpy(), separate.numpy())
    # with the next block's norm and QKV projection in the same op: the same y, and the
    # projection the separate norm, matmul and epilogue give
    _, next_norm, next_qkv, _ = _block_weights(d, 3 * d, activation, norm_bias, seed=7,
                                               group=group)
    y, following = im.int8_finish_block(attn, x, out, norm, up, down, activation, 1e-5, isa=isa,
                                        next_norm=next_norm, next_qkv=next_qkv)
    np.testing.assert_array_equal(y.numpy(), fused.numpy())
    h = kdense.layer_norm(y, next_norm["scale"], next_norm.get("bias"), 1e-5, isa=isa)
    np.testing.assert_array_equal(following.numpy(), kdense.epilogue(
        matmul(h, next_qkv), next_qkv.get("bias"), None, isa=isa).numpy())
    # and it is the block's math: against float64 with the dequantized weights (the op's
    # int8 activations cost up to 1/254 of a block's absmax per value)
    np.testing.assert_allclose(fused.numpy(), _block_reference(attn, x, out, norm, up, down,
                                                               activation), rtol=0.05, atol=0.05)


def _block_reference(attn, x, out, norm, up, down, activation):
    def lin(a, w):
        y = a @ im.dequantize_weight(w["q"].numpy(), w["scale"].numpy()).astype(np.float64).T
        return y + (w["bias"].numpy() if "bias" in w else 0)

    x1 = lin(attn.numpy().astype(np.float64), out) + x.numpy()
    mean = x1.mean(-1, keepdims=True) if "bias" in norm else 0
    var = ((x1 - mean) ** 2).mean(-1, keepdims=True)
    h = (x1 - mean) / np.sqrt(var + 1e-5) * norm["scale"].numpy() + (
        norm["bias"].numpy() if "bias" in norm else 0)
    z = lin(h, up)
    if activation == "swiglu":
        gate, value = np.split(z, 2, axis=-1)
        u = gate / (1 + np.exp(-gate)) * value
    else:
        u = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    return lin(u, down) + x1


def test_finish_block_refuses_weights_that_do_not_fit(compiled):
    out, norm, up, down = _block_weights(64, 256, "gelu_tanh", True, seed=0)
    attn = x = tf.zeros([2, 64])
    bad_down = {**down, "q": down["q"][:, :128], "scale": down["scale"]}
    with pytest.raises(tf.errors.InvalidArgumentError, match="down: x is .M, K. with K = 256"):
        im.int8_finish_block(attn, x, out, norm, up, bad_down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="x must be .M, D. = .2, 64."):
        im.int8_finish_block(attn, tf.zeros([3, 64]), out, norm, up, down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="norm_bias must be"):
        im.int8_finish_block(attn, x, out, {**norm, "bias": tf.zeros([63])}, up, down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next: x is .M, K. with K = 64"):
        im.int8_finish_block(attn, x, out, norm, up, down, next_norm=norm, next_qkv=down)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_norm_scale must be .64."):
        im.int8_finish_block(attn, x, out, norm, up, down, next_norm={"scale": tf.zeros([3])},
                             next_qkv=up)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_norm_bias must be"):
        im.int8_finish_block(attn, x, out, norm, up, down,
                             next_norm={**norm, "bias": tf.zeros([63])}, next_qkv=up)
    with pytest.raises(tf.errors.InvalidArgumentError, match="next_bias need next_q"):
        im.int8_finish_block(attn, x, out, norm, up, down, next_norm=norm,
                             next_qkv={"q": tf.zeros([0, 0], tf.int8),
                                       "scale": tf.zeros([0, 0])})
