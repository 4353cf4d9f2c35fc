"""Q4_0, Q4_1 and Q5_0 weights repacked into 8-row tiles at load (kernels/gguf_packed.py,
gguf_packed.h): the packing round-trips byte for byte, the compiled op reads the tiles as the
same matrix on each of its paths (against the gguf package's dequantize and a float64
product), a row's outputs keep their bits at any row count, the pure-TF path reads them, and
row counts that do not make tiles are refused."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import gguf_matmul as gm
from tokenserve.kernels.gguf_packed import PACKABLE, pack_rows, unpack_rows

from kernels.test_gguf_matmul_kernel import (check_against_references, dequantized, make_weights,
                                             make_x)

BASES = ["q4_0", "q4_1", "q5_0"]
ROWS = [1, 2, 3, 4, 5, 8, 67]  # rows of x: four a pass over a tile, and every remainder
SHAPES = [(608, 16), (96, 40)]  # (K, N): K not a multiple of 256; one tile and five


@pytest.fixture(scope="module")
def compiled():
    return compiled_op_module(gm.LIBRARY)


@pytest.mark.parametrize("base", BASES)
def test_packing_round_trips(base):
    blocks = make_weights(base, 24, 608)
    packed = pack_rows(blocks, base)
    assert packed.shape == blocks.shape and packed.dtype == np.uint8
    assert not np.array_equal(packed, blocks)  # it did move the bytes
    np.testing.assert_array_equal(unpack_rows(packed, PACKABLE[base]).numpy(), blocks)


def test_packed_q5_0_high_bits_land_by_row_and_value():
    """One fifth bit set, for row 5's value 13 of block 0: in the tiles, vector 3's uint32
    (values 12..15) holds it at bit 4 * 5 + 1."""
    blocks = np.zeros((8, 22), np.uint8)
    blocks[5, 2:6] = np.frombuffer(np.uint32(1 << 13).tobytes(), np.uint8)
    packed = pack_rows(blocks, "q5_0").reshape(-1)
    high = packed[16:48].view("<u4")
    assert high[3] == 1 << 21 and np.count_nonzero(high) == 1


@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("base", BASES)
def test_compiled_reads_tiles_as_the_same_matrix(compiled, base, m, k, n, isa):
    blocks = make_weights(base, n, k, seed=m)
    x = make_x(m, k, seed=m + 1)
    y = gm.compiled_gguf_matmul(x, pack_rows(blocks, base), PACKABLE[base], isa=isa).numpy()
    assert y.shape == (m, n)
    check_against_references(y.astype(np.float64), x, blocks, base)


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("base", BASES)
def test_a_rows_outputs_keep_their_bits_in_any_batch(compiled, base, isa):
    blocks = pack_rows(make_weights(base, 48, 640), base)
    x = make_x(9, 640)
    together = gm.compiled_gguf_matmul(x, blocks, PACKABLE[base], isa=isa).numpy()
    for i in range(len(x)):
        alone = gm.compiled_gguf_matmul(x[i:i + 1], blocks, PACKABLE[base], isa=isa).numpy()
        np.testing.assert_array_equal(alone[0], together[i])


@pytest.mark.parametrize("base", BASES)
def test_simd_and_scalar_paths_agree(compiled, base):
    blocks, x = pack_rows(make_weights(base, 40, 1536), base), make_x(5, 1536)
    scalar = gm.compiled_gguf_matmul(x, blocks, PACKABLE[base], isa="scalar").numpy()
    for isa in ("auto", "avx2"):
        np.testing.assert_allclose(
            gm.compiled_gguf_matmul(x, blocks, PACKABLE[base], isa=isa).numpy(), scalar,
            rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("base", BASES)
def test_fallback_dequantizes_tiles_as_the_files_rows(base, monkeypatch):
    blocks = make_weights(base, 16, 96)
    np.testing.assert_array_equal(
        gm.dequantize_blocks(pack_rows(blocks, base), PACKABLE[base]).numpy(),
        gm.dequantize_blocks(blocks, base).numpy())
    monkeypatch.setenv(gm.MODE_ENV, "fallback")
    x = make_x(3, 96)
    y = gm.gguf_matmul(x, pack_rows(blocks, base), PACKABLE[base]).numpy()
    np.testing.assert_allclose(y, x.astype(np.float64) @ dequantized(blocks, base).T,
                               rtol=1e-4, atol=1e-4)


def test_rows_that_do_not_make_tiles_are_refused(compiled):
    x, blocks = np.ones((1, 64), np.float32), np.zeros((12, 40), np.uint8)
    message = "q4_1x8 weights come in tiles of 8 rows, but blocks has 12"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        gm.compiled_gguf_matmul(x, blocks, "q4_1x8")
    with pytest.raises(ValueError, match=message):
        gm.gguf_matmul(x, blocks, "q4_1x8")
    with pytest.raises(ValueError, match="do not make tiles of 8 rows"):
        pack_rows(blocks, "q4_1")
