"""The LM head's int8 and float16 screens: their error bounds hold, and they pick the
float32 argmax, or with noise the argmax of the float32 logits plus it
(engine/step/head.py). In the engine: test_screened_head_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tokenserve.engine.step.head import ScreenedHead  # noqa: E402


def _weights(vocab=3000, width=96, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((vocab, width)).astype(np.float32) * 0.05
    weights[7] = weights[3]  # an exact tie: both are candidates, the lower id wins
    weights[11] *= 40.0      # a row far larger than the rest: its own scale
    return weights


@pytest.mark.parametrize("dtype", ["int8", "float16"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_bounds_hold_and_the_argmax_is_the_float32_one(layout, dtype):
    weights = _weights()
    rng = np.random.default_rng(1)
    bias = np.linspace(-0.5, 0.5, len(weights)).astype(np.float32) if layout == "kn" else 0.0
    head = ScreenedHead(tf.constant(weights if layout == "nk" else weights.T), layout,
                        None if layout == "nk" else tf.constant(bias), dtype=dtype)
    x = rng.standard_normal((6, weights.shape[1])).astype(np.float32)
    x[1] *= 50.0            # large activations
    x[2, 5] = 300.0         # one outlier: its block's quantization step is coarse
    x[3] = weights[3] * 30  # the tied pair is the argmax
    x[4] = 0.0              # nothing at all
    exact = x.astype(np.float64) @ weights.T.astype(np.float64) + bias
    approx, bound = (t.numpy() for t in head.bounds(tf.constant(x)))
    assert np.all(np.abs(approx - exact) <= bound)
    logits = head(tf.constant(x)).numpy()
    assert list(logits.argmax(-1)) == list((x @ weights.T + bias).argmax(-1))
    if layout == "nk":
        assert logits[3].argmax() == 3  # the tie, as np.argmax breaks it
    # every entry the screen could not rule out holds its float32 logit
    floor = (approx - bound).max(-1, keepdims=True)
    candidates = approx + bound >= floor
    # x = 0: every logit ties without a bias; with one, only the bias decides
    assert candidates[4].all() if layout == "nk" else candidates[4].sum() == 1
    assert candidates[[0, 1, 2, 3, 5]].mean() < 0.05  # elsewhere a screen, not the vocabulary
    np.testing.assert_allclose(logits[candidates], exact[candidates], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("dtype", ["int8", "float16"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_one_op_head_is_the_tf_ops_head(layout, dtype, isa):
    """The op (kernels/screened_logits.cc) against `reference`, the same math as TF ops: the same
    argmax, the screen's values where neither recomputes, and elsewhere values within the
    bound of each other (the op and TF may differ on a candidate at the bound's edge, and
    the op sums candidates in double)."""
    from tokenserve.kernels.head_screen import half_matmul, int8_row_matmul, screened_logits

    weights = _weights(vocab=1000, width=40, seed=5)
    rng = np.random.default_rng(6)
    bias = tf.constant(rng.standard_normal(1000).astype(np.float32)) if layout == "kn" else None
    head = ScreenedHead(tf.constant(weights if layout == "nk" else weights.T), layout, bias,
                        dtype=dtype)
    x = rng.standard_normal((7, 40)).astype(np.float32)
    x[2] *= 30.0
    x[5] = np.nan  # every entry NaN, as the float32 head gives it
    none = tf.zeros([0])
    got = screened_logits(tf.constant(x), head.screen, none if head.scale is None else head.scale,
                          head.row_bound, head.weight, none if bias is None else bias,
                          layout=layout, isa=isa).numpy()
    want = head.reference(tf.constant(x)).numpy()
    _, bound = (t.numpy() for t in head.bounds(tf.constant(x)))
    # the screen's values as the op's own path (AVX2 or scalar) sums them
    if dtype == "int8":
        approx = int8_row_matmul(tf.constant(x), head.screen, head.scale, isa=isa).numpy()
    else:
        approx = half_matmul(tf.constant(x), head.screen, isa=isa).numpy()
    approx += 0.0 if bias is None else bias.numpy()
    assert np.isnan(got[5]).all() and np.isnan(want[5]).all()
    rows = [0, 1, 2, 3, 4, 6]
    got, want, approx, bound = got[rows], want[rows], approx[rows], bound[rows]
    assert list(got.argmax(-1)) == list(want.argmax(-1))
    exact = x[rows].astype(np.float64) @ weights.T.astype(np.float64)
    exact += 0.0 if bias is None else bias.numpy()
    assert np.all(np.abs(got - exact) <= bound * 1.001 + 1e-5)
    # entries clearly in or out of the screen (not at its edge, where rounding decides):
    # those in hold the float32 logit, those out the screen's value (up to the last bits: the
    # compiler may contract the scalar sums into FMAs in one copy of them only)
    floor = (approx - bound).max(-1, keepdims=True)
    clear = np.abs(approx + bound - floor) > 1e-4 * np.abs(floor) + 1e-6
    candidate = approx + bound >= floor
    assert (clear & candidate).sum() >= len(rows)  # at least each row's argmax
    assert candidate.mean() < 0.05                 # and a screen, not the vocabulary
    np.testing.assert_allclose(got[clear & candidate], exact[clear & candidate], rtol=1e-6,
                               atol=1e-6)
    held = head.screen.numpy().astype(np.float64)
    if dtype == "int8":
        held *= head.scale.numpy()[:, None]
    rounding = 4 * 40 * 2.0 ** -24 * (np.abs(x[rows]) @ np.abs(held).T) + 1e-7
    out = clear & ~candidate
    assert np.all(np.abs(got[out] - approx[out]) <= rounding[out])


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("dtype", ["int8", "float16"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_with_noise_the_op_screens_the_argmax_of_logits_plus_noise(layout, dtype, isa):
    """A sampled row's draw is the argmax of its logits plus T x Gumbel noise
    (engine/sampler/draw.py); the op adds the noise and screens that argmax. Over 30 draws of
    noise at several temperatures (and a greedy row of zeros): the argmax of what it returns
    is the argmax of the float32 logits plus the noise, every entry that could win holds
    exactly that sum, and the others the screen's value plus the noise. The TF-ops
    reference agrees."""
    from tokenserve.kernels.head_screen import half_matmul, int8_row_matmul, screened_logits

    weights = _weights(vocab=1000, width=40, seed=8)
    rng = np.random.default_rng(9)
    bias = rng.standard_normal(1000).astype(np.float32) if layout == "kn" else None
    head = ScreenedHead(tf.constant(weights if layout == "nk" else weights.T), layout,
                        None if bias is None else tf.constant(bias), dtype=dtype)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    x[1] *= 20.0
    x[2] = weights[3] * 30  # a tied pair far ahead (nk), noise or not
    # the float32 logits as the op computes a candidate: summed in double, rounded once
    logits = (x.astype(np.float64) @ weights.T.astype(np.float64)).astype(np.float32)
    if bias is not None:
        logits = logits + bias
    none = tf.zeros([0])
    if dtype == "int8":
        approx = int8_row_matmul(tf.constant(x), head.screen, head.scale, isa=isa).numpy()
    else:
        approx = half_matmul(tf.constant(x), head.screen, isa=isa).numpy()
    approx += 0.0 if bias is None else bias
    temperatures = np.array([1.0, 0.3, 2.0, 1.0, 0.0], np.float32)[:, None]  # row 4 greedy
    screened = 0
    for _ in range(30):
        gumbel = -np.log(rng.standard_exponential((5, 1000)).astype(np.float32))
        noise = (temperatures * gumbel).astype(np.float32)
        got = screened_logits(tf.constant(x), head.screen,
                              none if head.scale is None else head.scale, head.row_bound,
                              head.weight, none if bias is None else tf.constant(bias),
                              layout=layout, isa=isa, noise=tf.constant(noise)).numpy()
        want = logits + noise
        assert list(got.argmax(-1)) == list(want.argmax(-1))
        reference = head.reference(tf.constant(x), tf.constant(noise)).numpy()
        assert list(reference.argmax(-1)) == list(want.argmax(-1))
        exact = got == want
        assert exact[np.arange(5), want.argmax(-1)].all()
        # elsewhere the screen's value plus the noise, up to the op's own rounding
        _, bound = (t.numpy() for t in head.bounds(tf.constant(x)))
        assert np.all(np.abs(got - want) <= bound * 1.001 + 1e-5)
        np.testing.assert_allclose(got[~exact], (approx + noise)[~exact], rtol=1e-5, atol=1e-4)
        screened += (~exact).mean() > 0.9
    assert screened == 30  # a screen, not the vocabulary recomputed


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_a_bfloat16_head_is_screened_against_its_widened_rows(layout, isa):
    """A bfloat16 model's head: the screen's bounds hold against the bfloat16 rows widened
    (what the fused head computes with, in float32), and the op returns their exact logits
    for the candidates; an op that read the 16-bit words as anything else would not."""
    from tokenserve.kernels.head_screen import screened_logits

    rounded = tf.cast(tf.constant(_weights(vocab=2000, width=72, seed=8)), tf.bfloat16)
    widened = tf.cast(rounded, tf.float32).numpy().astype(np.float64)
    rng = np.random.default_rng(9)
    bias = (tf.cast(tf.constant(rng.standard_normal(2000).astype(np.float32)), tf.bfloat16)
            if layout == "kn" else None)
    head = ScreenedHead(rounded if layout == "nk" else tf.transpose(rounded), layout, bias)
    assert head.weight.dtype == tf.bfloat16 and head.screen.dtype == tf.int8
    x = rng.standard_normal((5, 72)).astype(np.float32)
    x[1] *= 40.0
    x[2] = widened[11].astype(np.float32)  # the large row is the argmax
    exact = x.astype(np.float64) @ widened.T
    exact += 0.0 if bias is None else tf.cast(bias, tf.float32).numpy()
    approx, bound = (t.numpy() for t in head.bounds(tf.constant(x)))
    assert np.all(np.abs(approx - exact) <= bound)
    none = tf.zeros([0])
    got = screened_logits(tf.constant(x), head.screen, head.scale, head.row_bound, head.weight,
                          none if head.bias is None else head.bias, layout=layout,
                          isa=isa).numpy()
    assert list(got.argmax(-1)) == list(exact.argmax(-1))
    assert got[2].argmax() == 11
    best = exact.argmax(-1)
    np.testing.assert_allclose(got[np.arange(5), best], exact[np.arange(5), best], rtol=1e-6)
    want = head.reference(tf.constant(x)).numpy()
    assert list(want.argmax(-1)) == list(got.argmax(-1))


def test_the_one_op_head_refuses_shapes_that_do_not_fit():
    from tokenserve.kernels.head_screen import is_compiled, screened_logits

    if not is_compiled():
        pytest.skip("the op is not built here")
    head = ScreenedHead(tf.constant(_weights(vocab=50, width=8)), "nk")
    x, none = tf.zeros([2, 8]), tf.zeros([0])
    for args in ((x, head.screen, none, head.row_bound, head.weight, none),          # no scale
                 (x, head.screen, head.scale, head.row_bound[:49], head.weight, none),
                 (x, head.screen, head.scale, head.row_bound, tf.transpose(head.weight), none),
                 (x, head.screen, head.scale, head.row_bound, head.weight, tf.zeros([3]))):
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
            screened_logits(*args, layout="nk")


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_the_bound_is_tight_where_x_follows_a_rows_rounding(dtype):
    """x along row i's own rounding (to float16, or to int8 steps of its scale) makes that
    row's error r_i ||x||, the largest Cauchy-Schwarz allows: the bound must still cover it
    (it fails with r_i halved)."""
    weights = _weights(vocab=64, width=64, seed=2)
    head = ScreenedHead(tf.constant(weights), "nk", dtype=dtype)
    held = head.screen.numpy().astype(np.float64)
    if dtype == "int8":
        held *= head.scale.numpy().astype(np.float64)[:, None]
    else:
        assert head.scale is None
    residual = weights.astype(np.float64) - held
    x = (residual[5] / np.abs(residual[5]).max()).astype(np.float32)
    exact = weights.astype(np.float64) @ x.astype(np.float64)
    approx, bound = (t.numpy()[0] for t in head.bounds(tf.constant(x[None])))
    error = abs(approx[5] - exact[5])
    assert error <= bound[5]
    assert error > 0.5 * bound[5]  # the residual term dominates here, at its limit


def test_an_int8_screen_is_a_quarter_of_the_bytes_with_a_scale_per_row():
    weights = _weights(vocab=300, width=64)
    weights[20] = 0.0  # a row of zeros: scale 1, no division by zero
    head = ScreenedHead(tf.constant(weights), "nk")
    assert head.screen.dtype == tf.int8 and head.scale.shape == (300,)
    q, scale = head.screen.numpy(), head.scale.numpy()
    assert np.abs(q).max(axis=1).min() == 0 and np.abs(q[np.arange(300) != 20]).max(1).min() \
        == 127  # every other row spans the whole range
    assert np.all(np.abs(q * scale[:, None] - weights) <= scale[:, None] * 0.5001)
    assert head.nbytes == ScreenedHead.bytes_for((300, 64), "nk", "int8") == 300 * 64 + 300 * 8
    assert ScreenedHead.bytes_for((64, 300), "kn", "float16") == 300 * 64 * 2 + 300 * 4
    with pytest.raises(ValueError, match="dtype"):
        ScreenedHead(tf.constant(weights), "nk", dtype="int4")


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_a_row_that_is_not_finite_is_always_recomputed(dtype):
    """A NaN or infinite weight gives that row no finite screen value: its bound is infinite,
    so it is a candidate on every step and the step returns its float32 logit (NaN or
    inf), which the sampler's draw rule then handles as with the plain head."""
    weights = _weights(vocab=200, width=32)
    weights[9, 4] = np.nan
    weights[17, 0] = np.inf
    head = ScreenedHead(tf.constant(weights), "nk", dtype=dtype)
    x = np.random.default_rng(4).standard_normal((2, 32)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 0.1  # the inf weight meets a positive value: +inf
    logits = head(tf.constant(x)).numpy()
    assert np.isnan(logits[:, 9]).all() and np.isposinf(logits[:, 17]).all()
    finite = np.delete(np.arange(200), [9, 17])
    assert np.isfinite(logits[:, finite]).all()


def test_a_head_with_a_bias_keeps_it():
    weights = _weights(vocab=500, width=64)
    bias = np.linspace(-3, 3, 500).astype(np.float32)
    head = ScreenedHead(tf.constant(weights.T), "kn", tf.constant(bias))
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    want = x @ weights.T + bias
    got = head(tf.constant(x)).numpy()
    assert list(got.argmax(-1)) == list(want.argmax(-1))
    np.testing.assert_allclose(got.max(-1), want.max(-1), rtol=1e-6)
