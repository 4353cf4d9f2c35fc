"""The GGUF-block matmul on K-quant super-blocks (Q4_K, Q5_K, Q6_K as stored): the compiled op
on each path and the pure-TF fallback against float64 products by the `gguf` package's own
dequantize, on random super-blocks (every bit pattern of scales, mins and values; only the fp16
fields are kept finite), and refusals of blocks that do not fit.

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
ROWS = [1, 2, 3, 5, 8, 67]  # decode of a few streams, and a prefill chunk
SHAPES = [(768, 13), (256, 6)]  # (K, N): K an odd multiple of 256


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


def check_product(y: np.ndarray, x: np.ndarray, blocks: np.ndarray, name: str):
    """y is the float64 product by gguf's dequantized weights up to float32 rounding (the
    kernel multiplies float x by decoded float weights: no activation quantization)."""
    w = dequantized(blocks, name)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x.astype(np.float64) @ w.T), 2e-6 * magnitude + 1e-6)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", TYPES)
def test_compiled_matches_dequantize_references(compiled, name, m, k, n, isa):
    blocks, x = random_blocks(name, n, k, seed=m), make_x(m, k, seed=m + 1)
    y = gm.compiled_gguf_matmul(x, blocks, name, isa=isa).numpy()
    assert y.shape == (m, n)
    check_product(y.astype(np.float64), x, blocks, name)


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
