"""The fused paged decode-attention op (AVX2 and scalar paths, float32 and bfloat16, MHA and
GQA) and its pure-TF fallback against a NumPy reference; reading a variable after
scatter_update, graph mode and the ordering against the scatter, bad inputs."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import build as kbuild
from tokenserve.kernels import int8_matmul as im
from tokenserve.kernels import paged_attention as pa

# (H, Hkv, Dh): MHA and GQA on each AVX2 specialisation (Dh 32 / 64 / 128), the generic AVX2
# path (Dh 24, 72) and the scalar-only one (Dh 12, not a multiple of 8).
SHAPES = [(4, 4, 64), (4, 2, 64), (4, 2, 32), (8, 2, 128), (6, 3, 24), (2, 1, 72), (4, 2, 12)]
TOLERANCE = {tf.float32: 1e-5, tf.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(pa.LIBRARY)


def make(h, hkv, dh, s=6, length=70, num_rows=300, dtype=tf.float32, seed=0):
    """q [S, H, Dh], cache arrays [R, Hkv*Dh] and variables, rows [S, L] (distinct random rows
    anywhere in the cache), lengths [S] with 1, L, 0 and random ones. Values are rounded to
    the dtype, so the reference sees exactly what the op reads."""
    rng = np.random.default_rng(seed)
    cast = (lambda a: tf.cast(tf.cast(a, dtype), tf.float32).numpy())
    q = cast(rng.standard_normal((s, h, dh)).astype(np.float32) * 2)
    keys = cast(rng.standard_normal((num_rows, hkv * dh)).astype(np.float32))
    values = cast(rng.standard_normal((num_rows, hkv * dh)).astype(np.float32))
    rows = np.stack([rng.permutation(num_rows)[:length] for _ in range(s)]).astype(np.int32)
    lengths = np.array(([1, length, 0] + list(rng.integers(1, length + 1, s)))[:s], np.int32)
    key_var = tf.Variable(tf.cast(keys, dtype), trainable=False)
    value_var = tf.Variable(tf.cast(values, dtype), trainable=False)
    return q, keys, values, rows, lengths, key_var, value_var


def reference(q, keys, values, rows, lengths, scale, softcap=0.0):
    """float64: softmax over the valid positions of each head's own kv head; empty rows 0;
    with softcap, the scaled scores capped to softcap * tanh(s / softcap) first."""
    s, h, dh = q.shape
    hkv = keys.shape[1] // dh
    out = np.zeros((s, h, dh))
    for i in range(s):
        n = lengths[i]
        if n == 0:
            continue
        k = keys[rows[i, :n]].reshape(n, hkv, dh).astype(np.float64)
        v = values[rows[i, :n]].reshape(n, hkv, dh).astype(np.float64)
        for head in range(h):
            kv = head // (h // hkv)
            scores = k[:, kv] @ q[i, head] * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            p = np.exp(scores - scores.max())
            out[i, head] = (p / p.sum()) @ v[:, kv]
    return out.reshape(s, h * dh)


def check(out, ref, dtype):
    out = tf.cast(out, tf.float32).numpy()
    assert out.shape == ref.shape
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# The compiled op


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("span", ["auto", "one", "all"])
@pytest.mark.parametrize("h,hkv,dh", SHAPES)
def test_compiled_matches_reference(compiled, h, hkv, dh, span, isa, dtype):
    """Every kernel path; work items of one kv head, of whole rows and the automatic split."""
    q, keys, values, rows, lengths, kv, vv = make(h, hkv, dh, dtype=dtype)
    scale = 1 / np.sqrt(dh)
    out = pa.compiled_paged_decode_attention(tf.cast(q, dtype), kv, vv, rows, lengths, scale,
                                             isa=isa,
                                             kv_heads_per_item={"auto": 0, "one": 1,
                                                                "all": hkv}[span])
    assert out.dtype == dtype
    check(out, reference(q, keys, values, rows, lengths, scale), dtype)
    assert not tf.cast(out, tf.float32).numpy()[2].any()  # lengths[2] == 0: zeros


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("h,hkv,dh", [(4, 2, 32), (6, 3, 24), (4, 2, 12)])
def test_soft_capped_scores_match_the_reference_and_the_fallback(compiled, h, hkv, dh, isa):
    """Gemma 2's soft cap (softcap * tanh(s / softcap) on the scaled scores, before the
    softmax) in the op, both paths and the writing op, as the reference and the fallback."""
    q, keys, values, rows, lengths, kv, vv = make(h, hkv, dh)
    q = q * 4  # scores well past the cap, so that capping changes them
    scale, cap = 1 / np.sqrt(dh), 3.0
    want = reference(q, keys, values, rows, lengths, scale, cap)
    got = pa.compiled_paged_decode_attention(q, kv, vv, rows, lengths, scale, isa=isa,
                                             softcap=cap)
    check(got, want, tf.float32)
    check(pa.paged_decode_attention_fallback(q, kv, vv, rows, lengths, scale, softcap=cap),
          want, tf.float32)
    uncapped = reference(q, keys, values, rows, lengths, scale)
    assert not np.allclose(uncapped, want, atol=1e-2)  # the cap matters here
    # the writing op caps too (it writes one row that no query reads)
    spare = np.setdiff1d(np.arange(keys.shape[0]), rows)[:1].astype(np.int32)
    written = pa.paged_write_decode_attention(q, kv, vv, rows, lengths, keys[spare],
                                              values[spare], spare, scale, softcap=cap)
    check(written, want, tf.float32)


def test_paged_decode_attention_uses_the_compiled_op(compiled, monkeypatch):
    monkeypatch.delenv(pa.MODE_ENV, raising=False)
    monkeypatch.delenv(kbuild.KERNELS_ENV, raising=False)
    assert pa.kernel_status().startswith("compiled paged attention op")
    q, keys, values, rows, lengths, kv, vv = make(4, 2, 64, length=5)
    out = pa.paged_decode_attention(q, kv.handle, vv.handle, rows, lengths, 0.125)  # handles
    check(out, reference(q, keys, values, rows, lengths, 0.125), tf.float32)


def test_compiled_padding_rows_and_short_cache(compiled):
    """Padding entries past lengths may point at any valid row (row 0 here); one sequence."""
    q, keys, values, rows, lengths, kv, vv = make(2, 2, 64, s=1, length=9, num_rows=9)
    rows[0, 4:] = 0
    lengths[:] = 4
    out = pa.compiled_paged_decode_attention(q, kv, vv, rows, lengths, 0.125)
    check(out, reference(q, keys, values, rows, lengths, 0.125), tf.float32)


def test_compiled_reads_scattered_rows(compiled):
    """After scatter_update (the variable is then in copy-on-read mode) the op sees the new
    rows, and unchanged rows keep their values."""
    q, keys, values, rows, lengths, kv, vv = make(4, 2, 32, length=20)
    rng = np.random.default_rng(5)
    written = rows[:, :3].reshape(-1)
    new_k = rng.standard_normal((written.size, keys.shape[1])).astype(np.float32)
    new_v = rng.standard_normal((written.size, keys.shape[1])).astype(np.float32)
    kv.scatter_update(tf.IndexedSlices(new_k, written))
    vv.scatter_update(tf.IndexedSlices(new_v, written))
    keys[written], values[written] = new_k, new_v
    out = pa.compiled_paged_decode_attention(q, kv, vv, rows, lengths, 0.2)
    check(out, reference(q, keys, values, rows, lengths, 0.2), tf.float32)


def test_compiled_graph_mode_no_retrace_and_ordered_after_scatter(compiled, monkeypatch):
    """The engine's pattern: a tf.function with None dims scatters the new rows into the
    caches, then attends. Automatic control dependencies put the scatters before the op, so
    the same call reads what it just wrote; a second shape does not retrace."""
    monkeypatch.delenv(pa.MODE_ENV, raising=False)
    monkeypatch.delenv(kbuild.KERNELS_ENV, raising=False)
    _, keys, values, _, _, kv, vv = make(4, 2, 64, num_rows=200)
    width = keys.shape[1]

    @tf.function(input_signature=[tf.TensorSpec([None, None, None]), tf.TensorSpec([None]),
                                  tf.TensorSpec([None, None]), tf.TensorSpec([None, None]),
                                  tf.TensorSpec([None, None], tf.int32),
                                  tf.TensorSpec([None], tf.int32)])
    def step(q, write_rows, new_k, new_v, rows, lengths):
        kv.scatter_update(tf.IndexedSlices(new_k, tf.cast(write_rows, tf.int32)))
        vv.scatter_update(tf.IndexedSlices(new_v, tf.cast(write_rows, tf.int32)))
        return pa.paged_decode_attention(q, kv, vv, rows, lengths, 0.125)

    rng = np.random.default_rng(3)
    for s, length in [(3, 17), (5, 40)]:
        q = rng.standard_normal((s, 4, 64)).astype(np.float32)
        rows = np.stack([rng.permutation(200)[:length] for _ in range(s)]).astype(np.int32)
        lengths = rng.integers(1, length + 1, s).astype(np.int32)
        write = rows[np.arange(s), lengths - 1]  # each sequence's newest position
        new_k = rng.standard_normal((s, width)).astype(np.float32)
        new_v = rng.standard_normal((s, width)).astype(np.float32)
        out = step(q, write.astype(np.float32), new_k, new_v, rows, lengths)
        keys[write], values[write] = new_k, new_v
        check(out, reference(q, keys, values, rows, lengths, 0.125), tf.float32)
    assert step.experimental_get_tracing_count() == 1
    graph = step.get_concrete_function().graph
    [attention] = [op for op in graph.get_operations() if op.type == pa.OP_TYPE]
    assert {op.type for op in attention.control_inputs} == {"ResourceScatterUpdate"}
    assert len(attention.control_inputs) == 2  # after both the key and the value scatter
    assert "ReadVariableOp" not in {op.type for op in graph.get_operations()}  # no dense read


def test_compiled_static_shape_inference(compiled):
    _, _, _, _, _, kv, vv = make(4, 2, 64, num_rows=10)
    f = tf.function(lambda q, rows, lengths: pa.compiled_paged_decode_attention(
        q, kv, vv, rows, lengths, 0.125))
    concrete = f.get_concrete_function(tf.TensorSpec([5, 4, 64]),
                                       tf.TensorSpec([None, None], tf.int32),
                                       tf.TensorSpec([None], tf.int32))
    assert concrete.output_shapes == [5, 256]


def test_compiled_empty_batch_and_context(compiled):
    _, _, _, _, _, kv, vv = make(4, 2, 64, num_rows=10)
    out = pa.compiled_paged_decode_attention(np.zeros((0, 4, 64), np.float32), kv, vv,
                                             np.zeros((0, 5), np.int32), np.zeros(0, np.int32),
                                             0.125)
    assert out.shape == (0, 256)
    out = pa.compiled_paged_decode_attention(np.ones((2, 4, 64), np.float32), kv, vv,
                                             np.zeros((2, 0), np.int32), np.zeros(2, np.int32),
                                             0.125)
    assert out.shape == (2, 256) and not out.numpy().any()


BAD = {  # name: how bad_inputs spoils valid inputs
    "row past the end": dict(rows=lambda r: r.__setitem__((1, 2), 10)),
    "negative row": dict(rows=lambda r: r.__setitem__((0, 0), -1)),
    "padding row past the end": dict(rows=lambda r: r.__setitem__((0, 4), 10**6)),
    "H not a multiple of Hkv": dict(h=3),
    "length past L": dict(lengths=[2, 6]),
    "negative length": dict(lengths=[-1, 2]),
    "q rank 2": dict(q_shape=(2, 4 * 32)),
    "rows rank 1": dict(rows_shape=(5,)),
    "lengths rank 2": dict(lengths=[[2, 2]]),
    "S differs": dict(lengths=[2, 2, 2]),
    "Dh does not divide the row": dict(dh=48),
    "kv_heads_per_item does not divide Hkv": dict(kv_heads_per_item=3),
}


def bad_inputs(case):
    """Valid inputs for a [10, 2 * 32] cache, S = 2, L = 5, spoiled as `case` says."""
    spec = BAD[case]
    h, dh = spec.get("h", 4), spec.get("dh", 32)
    q = np.ones(spec.get("q_shape", (2, h, dh)), np.float32)
    rows = np.arange(10, dtype=np.int32)[:5][None].repeat(2, 0)
    if "rows" in spec:
        spec["rows"](rows)
    if "rows_shape" in spec:
        rows = np.zeros(spec["rows_shape"], np.int32)
    lengths = np.array(spec.get("lengths", [2, 5]), np.int32)
    return q, rows, lengths


@pytest.mark.parametrize("case", list(BAD))
def test_compiled_bad_inputs(compiled, case):
    kv = tf.Variable(tf.zeros([10, 64]))
    vv = tf.Variable(tf.zeros([10, 64]))
    q, rows, lengths = bad_inputs(case)
    per_item = BAD[case].get("kv_heads_per_item", 0)
    with pytest.raises(tf.errors.InvalidArgumentError):  # eager: the kernel's checks
        pa.compiled_paged_decode_attention(q, kv, vv, rows, lengths, 0.1,
                                           kv_heads_per_item=per_item)
    spec = [tf.TensorSpec(None, tf.float32), tf.TensorSpec(None, tf.int32),
            tf.TensorSpec(None, tf.int32)]
    f = tf.function(lambda q, r, n: pa.compiled_paged_decode_attention(
        q, kv, vv, r, n, 0.1, kv_heads_per_item=per_item), input_signature=spec)
    with pytest.raises(tf.errors.InvalidArgumentError):  # graph, unknown shapes: at run time
        f(q, rows, lengths)


def test_compiled_dtype_mismatch(compiled):
    kv = tf.Variable(tf.zeros([10, 64]))
    q = tf.ones([1, 2, 32], tf.bfloat16)
    rows, lengths = np.zeros((1, 3), np.int32), np.ones(1, np.int32)
    with pytest.raises(TypeError, match="float32"):
        pa.compiled_paged_decode_attention(q, kv, kv, rows, lengths, 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="float"):  # handles: the kernel
        pa.compiled_paged_decode_attention(q, kv.handle, kv.handle, rows, lengths, 0.1)


# --------------------------------------------------------------------------------------------
# The pure-TF fallback


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("h,hkv,dh", [(4, 4, 64), (4, 2, 64), (6, 3, 24)])
def test_fallback_matches_reference(h, hkv, dh, dtype):
    q, keys, values, rows, lengths, kv, vv = make(h, hkv, dh, dtype=dtype)
    scale = 1 / np.sqrt(dh)
    out = pa.paged_decode_attention_fallback(tf.cast(q, dtype), kv, vv, rows, lengths, scale)
    assert out.dtype == dtype
    tol = {tf.float32: 1e-5, tf.bfloat16: 4e-2}[dtype]  # scores are rounded to bf16 here
    np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(),
                               reference(q, keys, values, rows, lengths, scale), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("env", [pa.MODE_ENV, kbuild.KERNELS_ENV])
def test_forced_fallback_graph_mode(env, monkeypatch):
    monkeypatch.delenv(pa.MODE_ENV, raising=False)
    monkeypatch.delenv(kbuild.KERNELS_ENV, raising=False)
    monkeypatch.setenv(env, "fallback")
    assert pa.kernel_status() == f"pure-TF fallback: {env}=fallback"
    if env == kbuild.KERNELS_ENV:  # every op, the int8 matmul included
        monkeypatch.delenv(im.MODE_ENV, raising=False)
        assert im.kernel_status() == f"pure-TF fallback: {env}=fallback"
    _, keys, values, _, _, kv, vv = make(4, 2, 32, num_rows=50)
    spec = [tf.TensorSpec([None, None, None]), tf.TensorSpec([None, None], tf.int32),
            tf.TensorSpec([None], tf.int32)]
    f = tf.function(lambda q, r, n: pa.paged_decode_attention(q, kv, vv, r, n, 0.15),
                    input_signature=spec)
    rng = np.random.default_rng(2)
    for s, length in [(2, 7), (4, 30)]:
        q = rng.standard_normal((s, 4, 32)).astype(np.float32)
        rows = rng.integers(0, 50, (s, length)).astype(np.int32)
        lengths = np.array([length, 0, 1, 3][:s], np.int32)
        check(f(q, rows, lengths), reference(q, keys, values, rows, lengths, 0.15), tf.float32)
    assert f.experimental_get_tracing_count() == 1
    assert pa.OP_TYPE not in {op.type for op in f.get_concrete_function().graph
                              .get_operations()}


@pytest.mark.parametrize("case", ["row past the end", "negative row", "H not a multiple of Hkv",
                                  "length past L"])
def test_fallback_bad_inputs(case):
    kv = tf.Variable(tf.zeros([10, 64]))
    vv = tf.Variable(tf.zeros([10, 64]))
    q, rows, lengths = bad_inputs(case)
    with pytest.raises(tf.errors.InvalidArgumentError):
        pa.paged_decode_attention_fallback(q, kv, vv, rows, lengths, 0.1)


def test_missing_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.delenv(pa.MODE_ENV, raising=False)
    monkeypatch.delenv(kbuild.KERNELS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    monkeypatch.setattr(pa.LIBRARY, "_loaded", None)  # a fresh process, as far as loading goes
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert pa.kernel_status().startswith("pure-TF fallback: g++ not found")
    q, keys, values, rows, lengths, kv, vv = make(4, 2, 32, length=8, num_rows=40)
    check(pa.paged_decode_attention(q, kv, vv, rows, lengths, 0.2),
          reference(q, keys, values, rows, lengths, 0.2), tf.float32)
