"""The LM head screen's matmul ops (kernels/head_screen.cc), float16 weights and int8 weights
with a scale per row, against NumPy, both their paths."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tokenserve.kernels import head_screen as hm  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    if not hm.is_compiled():
        pytest.skip(f"the op is not built here: {hm.kernel_status()}")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [8, 37, 96, 768])
@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_products_match_numpy(compiled, m, k, isa):
    rng = np.random.default_rng(m * 1000 + k)
    n = 517  # two tiles of 256 and a few rows over: the last rows of a tile, fewer than four
    w = rng.standard_normal((n, k)).astype(np.float16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = hm.half_matmul(tf.constant(x), tf.constant(w), isa=isa).numpy()
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * k * 2.0 ** -24 * np.abs(want).max()
                               + 1e-6)


def test_the_fallback_and_the_op_agree_and_shapes_are_checked(compiled):
    rng = np.random.default_rng(0)
    w = tf.constant(rng.standard_normal((40, 24)).astype(np.float16))
    x = tf.constant(rng.standard_normal((3, 24)).astype(np.float32))
    np.testing.assert_allclose(hm.half_matmul(x, w).numpy(),
                               hm.half_matmul_fallback(x, w).numpy(), rtol=1e-5, atol=1e-5)
    assert hm.half_matmul(tf.zeros([0, 24]), w).shape == (0, 40)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        hm.half_matmul(tf.zeros([2, 23]), w)
    assert "head screen op" in hm.kernel_status()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [8, 37, 96, 768])
@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_int8_products_match_numpy(compiled, m, k, isa):
    rng = np.random.default_rng(m * 1000 + k + 7)
    n = 517
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    q[3] = -128  # the one value outside the symmetric range still widens right
    scale = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    sums = x.astype(np.float64) @ q.astype(np.float64).T
    want = sums * scale
    got = hm.int8_row_matmul(tf.constant(x), tf.constant(q), tf.constant(scale),
                             isa=isa).numpy()
    assert got.shape == (m, n)
    # float32 sums of k terms, then one product with the scale
    magnitude = np.abs(x).astype(np.float64) @ np.abs(q.astype(np.float64)).T * scale
    tolerance = 4 * k * 2.0 ** -24 * magnitude + 1e-6
    assert np.all(np.abs(got - want) <= tolerance)


def test_the_int8_fallback_and_the_op_agree_and_shapes_are_checked(compiled):
    rng = np.random.default_rng(1)
    q = tf.constant(rng.integers(-127, 128, (40, 24)).astype(np.int8))
    scale = tf.constant(rng.uniform(0.01, 0.1, 40).astype(np.float32))
    x = tf.constant(rng.standard_normal((3, 24)).astype(np.float32))
    np.testing.assert_allclose(hm.int8_row_matmul(x, q, scale).numpy(),
                               hm.int8_row_matmul_fallback(x, q, scale).numpy(),
                               rtol=1e-5, atol=1e-5)
    assert hm.int8_row_matmul(tf.zeros([0, 24]), q, scale).shape == (0, 40)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        hm.int8_row_matmul(tf.zeros([2, 23]), q, scale)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        hm.int8_row_matmul(x, q, scale[:39])
