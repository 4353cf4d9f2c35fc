"""The LoRA ops (kernels/lora_finish_block.cc, lora_delta.h) against the plain fused ops plus
each row's delta written out in numpy: rows of different adapters and of the base, both
activations, with and without the next block's QKV, row groups longer than one work item,
widths off the column block, and bad groups and factor shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module
from support.finish_blocks import block_weights
from tokenserve.kernels import dense as kd

LAYERS = 3


@pytest.fixture(scope="module")
def compiled():
    return compiled_op_module(kd.LIBRARY)


def _factors(rng, slots, rank, width_in, width_out):
    """The S slots' (A [L, in, R], B [L, R, out]) as numpy lists (slot s at s - 1)."""
    a = [(rng.standard_normal((LAYERS, width_in, rank)) / np.sqrt(width_in)).astype(np.float32)
         for _ in range(slots)]
    b = [(rng.standard_normal((LAYERS, rank, width_out)) * 0.3).astype(np.float32)
         for _ in range(slots)]
    return a, b


def _groups(row_slot, slots):
    """(order, offsets) as engine/step/lora.py makes them."""
    order = np.argsort(row_slot, kind="stable").astype(np.int32)
    counts = np.bincount(row_slot, minlength=slots + 1)
    return tf.constant(order), tf.constant(np.concatenate([[0], np.cumsum(counts)]).astype(
        np.int32))


def _delta(x, factor, row_slot, layer):
    """Each row's (x[row] @ A_s[layer]) @ B_s[layer], in float64; zeros for slot 0."""
    x = np.asarray(x, np.float64)
    a, b = factor
    out = np.zeros((x.shape[0], b[0].shape[-1]))
    for row, slot in enumerate(row_slot):
        if slot:
            out[row] = x[row] @ a[slot - 1][layer] @ b[slot - 1][layer]
    return out


def _tf(factor):
    return [tf.constant(v) for v in factor[0]], [tf.constant(v) for v in factor[1]]


@pytest.mark.parametrize("m,width,out,rank,slots", [
    (1, 40, 200, 16, 1),     # one decode row: columns split between the threads
    (37, 64, 300, 8, 3),     # 3 adapters and the base, groups past 8 rows, a column tail
    (6, 24, 64, 48, 4)])     # a fused QKV rank, a slot with no rows
def test_lora_delta_adds_each_rows_own_adapter(compiled, m, width, out, rank, slots):
    rng = np.random.default_rng(m)
    row_slot = rng.integers(0, slots + 1, size=m) if m > 1 else np.array([1])
    x = rng.standard_normal((m, width)).astype(np.float32)
    y = rng.standard_normal((m, out)).astype(np.float32)
    factor = _factors(rng, slots, rank, width, out)
    got = kd.lora_delta(tf.constant(y), tf.constant(x), _groups(row_slot, slots), *_tf(factor),
                        layer=1)
    np.testing.assert_allclose(got.numpy(), y + _delta(x, factor, row_slot, 1), rtol=1e-5,
                               atol=1e-5)
    base = row_slot == 0
    np.testing.assert_array_equal(got.numpy()[base], y[base])  # the base's rows untouched


@pytest.mark.parametrize("activation,norm_bias,m,d,f,slots", [
    ("gelu_tanh", True, 5, 64, 256, 3),   # GPT-2: LayerNorm, biases; 3 adapters and the base
    ("swiglu", False, 1, 40, 344, 1),     # one row on one adapter
    ("swiglu", False, 20, 72, 200, 2)])   # packed chunks from 9 rows, groups past 8 rows
def test_lora_finish_block_equals_the_separate_ops(compiled, activation, norm_bias, m, d, f,
                                                   slots):
    out, norm, up, down = block_weights(d, f, activation, norm_bias, seed=m + d)
    _, next_norm, next_qkv, _ = block_weights(d, 3 * d, activation, norm_bias, seed=7)
    rng = np.random.default_rng(2)
    attn = rng.standard_normal((m, d)).astype(np.float32)
    x = rng.standard_normal((m, d)).astype(np.float32) * 3
    row_slot = rng.integers(0, slots + 1, size=m) if m > 1 else np.array([1])
    inner = f // 2 if activation == "swiglu" else f
    factors = {"out": _factors(rng, slots, 4, d, d), "up": _factors(rng, slots, 8, d, f),
               "down": _factors(rng, slots, 4, inner, d),
               "qkv": _factors(rng, slots, 12, d, 3 * d)}
    groups = _groups(row_slot, slots)
    layer = 1
    as_tf = {role: _tf(factor) for role, factor in factors.items()}
    y, following = kd.lora_finish_block(attn, x, out, norm, up, down, groups, as_tf, layer,
                                        activation, 1e-5, next_norm=next_norm,
                                        next_qkv=next_qkv)
    alone = kd.lora_finish_block(attn, x, out, norm, up, down, groups, as_tf, layer,
                                 activation, 1e-5)

    def plus(y, inputs, role, at=layer):
        return y + tf.constant(_delta(inputs, factors[role], row_slot, at), tf.float32)

    x1 = plus(kd.dense(attn, out["kernel"], out.get("bias"), x), attn, "out")
    h = kd.layer_norm(x1, norm["scale"], norm.get("bias"), 1e-5)
    u = kd.epilogue(plus(kd.dense(h, up["kernel"], up.get("bias")), h, "up"),
                    activation=activation)
    expected = plus(kd.dense(u, down["kernel"], down.get("bias"), x1), u, "down")
    np.testing.assert_allclose(y.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(alone.numpy(), y.numpy(), rtol=1e-5, atol=1e-5)
    h = kd.layer_norm(expected, next_norm["scale"], next_norm.get("bias"), 1e-5)
    expected_next = plus(kd.dense(h, next_qkv["kernel"], next_qkv.get("bias")), h, "qkv",
                         layer + 1)  # the next block's factors are the next layer's
    np.testing.assert_allclose(following.numpy(), expected_next.numpy(), rtol=1e-4, atol=1e-4)
    # the base model's rows are the plain fused op's
    base = row_slot == 0
    if base.any():
        plain = kd.finish_block(attn, x, out, norm, up, down, activation, 1e-5).numpy()
        np.testing.assert_allclose(y.numpy()[base], plain[base], rtol=1e-5, atol=1e-5)


def test_lora_ops_refuse_groups_and_factors_that_do_not_fit(compiled):
    out, norm, up, down = block_weights(64, 256, "gelu_tanh", True, seed=0)
    rng = np.random.default_rng(0)
    attn = x = tf.zeros([2, 64])
    factors = {"out": _tf(_factors(rng, 2, 4, 64, 64)), "up": _tf(_factors(rng, 2, 4, 64, 256)),
               "down": _tf(_factors(rng, 2, 4, 256, 64)),
               "qkv": _tf(_factors(rng, 2, 4, 64, 192))}
    groups = _groups(np.array([1, 2]), 2)
    bad = dict(factors, up=_tf(_factors(rng, 2, 4, 63, 256)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="LoRA factors of up"):
        kd.lora_finish_block(attn, x, out, norm, up, down, groups, bad, 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="layer 3 < L"):
        kd.lora_finish_block(attn, x, out, norm, up, down, groups, factors, LAYERS)
    twice = (tf.constant([0, 0], tf.int32), groups[1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="permutation"):
        kd.lora_finish_block(attn, x, out, norm, up, down, twice, factors, 0)
    short = (groups[0], tf.constant([0, 0, 2], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"offsets must be \[S \+ 2\]"):
        kd.lora_delta(tf.zeros([2, 64]), x, short, *factors["out"], layer=0)
    spans = kd.full_lora_spans({"out": factors["out"]})
    too_far = [tf.tensor_scatter_nd_update(s, [[0, 1, 0, 1]], [5]) for s in spans]  # r1 > R
    with pytest.raises(tf.errors.InvalidArgumentError, match="LoRA span of x"):
        kd.lora_delta(tf.zeros([2, 64]), x, groups, *factors["out"], 0, too_far, "out")


def _fused_qkv_factors(rng, q: int, kv: int, width: int):
    """2 slots' fused-QKV factors as the slot table holds a Llama adapter of rank 4 on k, q
    and v (packed in that order into R = 16, each on its own columns, rows 12..16 empty);
    slot 2 leaves layer 1 alone."""
    out, rank = q + 2 * kv, 16
    a, b = _factors(rng, 2, rank, width, out)
    for slot in range(2):
        b[slot][:, 12:] = 0
        for rows, (c0, c1) in zip(((0, 4), (4, 8), (8, 12)),
                                  ((q, q + kv), (0, q), (q + kv, out))):
            keep = np.zeros(out, bool)
            keep[c0:c1] = True
            b[slot][:, rows[0]:rows[1], ~keep] = 0
    a[1][1], b[1][1] = 0, 0
    return a, b


@pytest.mark.parametrize("m", [3, 21])  # the calling thread alone; the thread team
def test_lora_delta_reads_only_the_pieces_an_adapter_fills(compiled, m):
    from tokenserve.engine.step.lora import filled_pieces

    q, kv, width = 50, 20, 24
    rng = np.random.default_rng(5)
    a, b = _fused_qkv_factors(rng, q, kv, width)
    assert filled_pieces(b[0][0], kd.LORA_PIECES).tolist() == [
        [0, 4, q, q + kv], [4, 8, 0, q], [8, 12, q + kv, q + 2 * kv]]
    assert not filled_pieces(b[1][1], kd.LORA_PIECES).any()
    spans = np.zeros([2, LAYERS, 4, kd.LORA_PIECES, 4], np.int32)
    for slot in range(2):
        for layer in range(LAYERS):
            spans[slot, layer, 0] = filled_pieces(b[slot][layer], kd.LORA_PIECES)
    row_slot = np.arange(m) % 3  # the base and both slots
    x = rng.standard_normal((m, width)).astype(np.float32)
    y = rng.standard_normal((m, q + 2 * kv)).astype(np.float32)
    for layer in range(LAYERS):
        got = kd.lora_delta(tf.constant(y), tf.constant(x), _groups(row_slot, 2),
                            *_tf((a, b)), layer, [tf.constant(s) for s in spans], "qkv")
        np.testing.assert_allclose(got.numpy(), y + _delta(x, (a, b), row_slot, layer),
                                   rtol=1e-5, atol=1e-5)
    # the op reads what the spans say: without slot 1's k piece, its k columns stay as they were
    spans[0, 0, 0, 0] = 0
    got = kd.lora_delta(tf.constant(y), tf.constant(x), _groups(row_slot, 2), *_tf((a, b)), 0,
                        [tf.constant(s) for s in spans], "qkv").numpy()
    rows = row_slot == 1
    np.testing.assert_array_equal(got[rows][:, q:q + kv], y[rows][:, q:q + kv])
    assert not np.allclose(got[rows][:, :q], y[rows][:, :q])


@pytest.mark.parametrize("pieces", [
    None,                                        # the whole factor
    [[0, 6, 0, 100], [6, 16, 100, 330]],         # pieces on columns of their own
    [[0, 8, 0, 330], [8, 16, 50, 200]]])         # pieces that share columns
def test_a_rows_delta_has_the_same_bits_alone_and_in_a_batch(compiled, pieces):
    """A decode row alone (its delta on the op's own thread, into a buffer then added) and
    the same row among 40 rows of 3 adapters (the thread team's work items of up to 8 rows
    of a slot by column ranges, added straight into y where the pieces' columns are their
    own) get the very same delta, so a stream's tokens do not depend on what shares its
    step."""
    rng = np.random.default_rng(11)
    m, width, out, rank, slots = 40, 96, 330, 16, 3
    row_slot = np.arange(m) % (slots + 1)
    x = rng.standard_normal((m, width)).astype(np.float32)
    y = rng.standard_normal((m, out)).astype(np.float32)
    factor = _tf(_factors(rng, slots, rank, width, out))
    spans = None
    if pieces is not None:
        table = np.zeros([LAYERS, 4, kd.LORA_PIECES, 4], np.int32)
        table[:, 0, :len(pieces)] = pieces
        spans = [tf.constant(table)] * slots
    batch = kd.lora_delta(tf.constant(y), tf.constant(x), _groups(row_slot, slots), *factor,
                          layer=2, spans=spans).numpy()
    for row in (1, 2, 7):  # one row of each adapter, alone
        alone = kd.lora_delta(tf.constant(y[row:row + 1]), tf.constant(x[row:row + 1]),
                              _groups(row_slot[row:row + 1], slots), *factor, layer=2,
                              spans=spans).numpy()
        np.testing.assert_array_equal(alone[0], batch[row])
