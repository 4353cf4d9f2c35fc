"""The GGUF-block matmul on K-quant super-blocks (Q4_K, Q5_K, Q6_K as stored): the compiled op
on each path (integer dot products against q8_K activations) and the pure-TF fallback against
float64 products by the `gguf` package's own dequantize, on random super-blocks (every bit
pattern of scales, mins and values; only the fp16 fields are kept finite), and refusals of
blocks that do not fit.

gguf.quants cannot quantize to the K-quants (only dequantize), hence random bytes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import gguf_matmul as gm

TYPES = ["q4_k", "q5_k", "q6_k"]
BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
HALVES = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}  # where each type's fp16 fields sit
# up to four rows of x: each super-block unpacked on the way (1..4 reach every group size);
# more: each weight row unpacked once into a buffer that the rows sweep in fours (5 and 9:
# a single-row tail, 33 and 64: a prefill chunk)
ROWS = [1, 2, 3, 4, 5, 9, 33, 64]
SHAPES = [(768, 13), (256, 6)]  # (K, N): K an odd multiple of 256, N not a multiple of 4


@pytest.fixture(scope="module")
def compiled():
    return compiled_op_module(gm.LIBRARY)


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [N, K / 256 * block bytes]: random bytes, the fp16 scales set to finite ones of
    trained weights' size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, BYTES[name]), dtype=np.uint8)
    for at in HALVES[name]:
        scale = (rng.standard_normal((n, k // 256)) * 0.01).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def dequantized(blocks: np.ndarray, name: str) -> np.ndarray:
    return gguf_quants.dequantize(blocks, GGMLQuantizationType[name.upper()]).astype(np.float64)


def make_x(m: int, k: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 20
    return x


def q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 as the op quantizes it, q8_K blocks of 256 with a step per 8 values:
    (q [M, K], step [M, K]) with x ~= q * step, step = d * m_g, d = max|x| / (127 * 16) of the
    block and m_g = ceil(max|x in g| * (16 / max|x|)) in [1, 16]. The same float32 operations as
    the op (one multiply by 1 / step, round half to even), so the same q."""
    m, k = x.shape
    groups = x.reshape(m, k // 256, 32, 8)
    gmax = np.abs(groups).max(axis=-1, keepdims=True)
    amax = gmax.max(axis=-2, keepdims=True)
    r = np.where(amax > 0, np.float32(16) / np.where(amax > 0, amax, 1), np.float32(0))
    multiple = np.clip(np.ceil(gmax * r.astype(np.float32)), 1, 16).astype(np.float32)
    unit = (amax / np.float32(127 * 16)).astype(np.float32)
    step = (unit * multiple).astype(np.float32)
    inv = np.where(amax > 0, np.float32(1) / np.where(amax > 0, step, 1), np.float32(0))
    q = np.rint(groups * inv.astype(np.float32))
    step = np.broadcast_to(step, groups.shape).reshape(m, k)
    return q.reshape(m, k).astype(np.float64), step.astype(np.float64)


def check_product(y: np.ndarray, x: np.ndarray, blocks: np.ndarray, name: str):
    """y is x @ w.T for gguf's dequantized w (float64) up to the activations' rounding to q8_K:
    at most half a step of each value's group, |y - x @ w.T| <= sum_k |w_k| d_k / 2. And with
    that rounding done as the op does, y is the float64 product up to float32 rounding."""
    w = dequantized(blocks, name)
    q, d_per_value = q8_k(x)  # [M, K] each
    x_hat = q * d_per_value
    magnitude = np.abs(x_hat) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x_hat @ w.T), 2e-6 * magnitude + 1e-6)
    rounding = (0.5 + 1e-4) * (d_per_value @ np.abs(w).T)
    np.testing.assert_array_less(np.abs(y - x.astype(np.float64) @ w.T),
                                 rounding + 1e-5 * magnitude + 1e-6)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", TYPES)
def test_compiled_matches_dequantize_references(compiled, name, m, k, n, isa):
    blocks, x = random_blocks(name, n, k, seed=m), make_x(m, k, seed=m + 1)
    y = gm.compiled_gguf_matmul(x, blocks, name, isa=isa).numpy()
    assert y.shape == (m, n)
    check_product(y.astype(np.float64), x, blocks, name)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("name", TYPES)
def test_rows_split_over_threads(compiled, name, m, isa):
    """Enough weight rows (K = 2048) that the op hands chunks of them to several threads."""
    blocks, x = random_blocks(name, 300, 2048, seed=7), make_x(m, 2048, seed=8)
    y = gm.compiled_gguf_matmul(x, blocks, name, isa=isa).numpy()
    check_product(y.astype(np.float64), x, blocks, name)


# every value, scale and min at its largest: the integer sums' widest case (no saturation)
LARGEST = {"q4_k": {range(4, 144): 0xFF}, "q5_k": {range(4, 176): 0xFF},
           "q6_k": {range(0, 192): 0xFF, range(192, 208): 0x80}}  # Q6_K scales -128


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("name", TYPES)
def test_largest_values_and_scales(compiled, name, isa):
    blocks = random_blocks(name, 4, 512).reshape(4, 2, BYTES[name])
    for span, byte in LARGEST[name].items():
        blocks[..., span.start:span.stop] = byte
    blocks = blocks.reshape(4, -1)
    x = np.full((5, 512), 3.0, np.float32)
    x[1] *= -1  # qx all 127, then all -127
    for m in (2, 5):  # each super-block unpacked on the way, and unpacked into a buffer
        y = gm.compiled_gguf_matmul(x[:m], blocks, name, isa=isa).numpy()
        check_product(y.astype(np.float64), x[:m], blocks, name)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_matmul_takes_the_type_by_gguf_name(compiled, name):
    blocks, x = random_blocks(name, 40, 1280), make_x(4, 1280)
    y = gm.gguf_matmul(x, blocks, GGMLQuantizationType[name.upper()]).numpy()
    check_product(y.astype(np.float64), x, blocks, name)


@pytest.mark.parametrize("name", TYPES)
def test_fallback_dequantizes_as_gguf_does(name):
    blocks = random_blocks(name, 7, 768)
    np.testing.assert_allclose(gm.dequantize_blocks(blocks, name).numpy(),
                               dequantized(blocks, name), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", TYPES)
def test_fallback_is_the_float_product(name, monkeypatch):
    monkeypatch.setenv(gm.MODE_ENV, "fallback")
    blocks, x = random_blocks(name, 9, 512), make_x(3, 512)
    y = gm.gguf_matmul(x, blocks, name).numpy()
    np.testing.assert_allclose(y, x.astype(np.float64) @ dequantized(blocks, name).T,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, k, row_bytes, message", [
    ("q4_k", 288, 162, "K = 288 does not divide into q4_k blocks of 256 values"),
    ("q6_k", 512, 420 - 1,
     "q6_k weights for K = 512 need 420 bytes a row (2 blocks of 210), but blocks has 419"),
    ("q5_k", 256, 144, "need 176 bytes a row"),  # Q4_K's bytes given as Q5_K
])
def test_blocks_that_do_not_fit_are_refused(compiled, name, k, row_bytes, message):
    x = np.ones((2, k), np.float32)
    blocks = np.zeros((4, row_bytes), np.uint8)
    message = re.escape(message)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        gm.compiled_gguf_matmul(x, blocks, name)
    with pytest.raises(ValueError, match=message):
        gm.gguf_matmul(x, blocks, name)
    with pytest.raises(ValueError, match=message):
        gm.gguf_matmul_fallback(x, blocks, name)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_non_finite_x_gives_nan_rows(compiled, isa):
    blocks, x = random_blocks("q4_k", 5, 512), make_x(3, 512)
    x[1, 300] = np.nan
    y = gm.compiled_gguf_matmul(x, blocks, "q4_k", isa=isa).numpy()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
