"""The mixture-of-experts layer op on experts kept as GGUF blocks (TokenserveMoeGgufLayer)
against the stock-TF grouping whose expert matmuls are the dense block op (the same q8
activations), and against a float64 per-token loop on the dequantized weights; experts
without rows are not read; bad blocks are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module, use_compiled_op
from tokenserve.kernels import moe as kmoe
from tokenserve.kernels.gguf_matmul import LIBRARY as GGUF_LIBRARY
from tokenserve.kernels.gguf_matmul import dequantize_blocks
from tokenserve.model.gguf_linear import blocks_entries
from tokenserve.model.moe import grouped_experts, route, shared_expert

gguf = pytest.importorskip("gguf")


def blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """uint8 [rows, cols / values * bytes]: random weights in `kind` (K-quants: random
    super-blocks with a sane scale, as the dense block tests write them)."""
    from support.gguf_files import K_QUANTS, kquant_blocks

    if kind.upper() in K_QUANTS:
        return kquant_blocks(rows, cols, kind.upper(), rng)
    values = rng.normal(0, 0.3, [rows, cols]).astype(np.float32)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind.upper()])


def expert_blocks(rng, d: int, f: int, types: tuple[str, str, str]):
    """((type, blocks) for gate [F, D], up [F, D], down [D, F])."""
    return tuple((kind, blocks(rng, *shape, kind))
                 for kind, shape in zip(types, ((f, d), (f, d), (d, f))))


def dequantized(expert) -> tuple[np.ndarray, np.ndarray]:
    """float64 ([D, 2F] up, [F, D] down) as the per-token loop takes them."""
    gate, up, down = (dequantize_blocks(b, kind).numpy().astype(np.float64)
                      for kind, b in expert)
    return np.concatenate([gate.T, up.T], 1), down.T


def routed_loop(x, router, k, normalize, experts, shared=None, residual=None):
    """(y, ids): the router's top-k of a float64 softmax, each row through its experts."""
    x64 = x.astype(np.float64)
    logits = x64 @ router.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, -1, kind="stable")[:, :k]
    y = np.zeros_like(x64) if residual is None else residual.astype(np.float64).copy()
    weights = [dequantized(e) for e in experts]
    for r in range(len(x)):
        chosen = probs[r, ids[r]]
        gates = chosen / chosen.sum() if normalize else chosen
        pairs = list(zip(ids[r], gates))
        if shared is not None:
            pairs.append((len(experts), 1 / (1 + np.exp(-(x64[r] @ shared[0][:, 0])))))
        for e, g in pairs:
            up, down = weights[e] if e < len(experts) else dequantized(shared[1])
            gate, value = np.split(x64[r] @ up, 2)
            y[r] += g * ((gate / (1 + np.exp(-gate)) * value) @ down)
    return y, ids


def stock_tf(x, router, k, normalize, experts, shared=None):
    """model/moe.py's routing and grouping, each expert's matmuls the dense block op."""
    def linear(*parts):
        return blocks_entries([kind for kind, _ in parts], [b for _, b in parts])

    h = tf.constant(x)
    ids, gates = route(h @ router, k, normalize)
    y = grouped_experts(h, ids, gates, [{"up": linear(g, u), "down": linear(d)}
                                        for g, u, d in experts])
    if shared is not None:
        g, u, d = shared[1]
        y += shared_expert(h, {"up": linear(g, u), "down": linear(d),
                               "gate": {"kernel": shared[0]}})
    return y.numpy()


@pytest.fixture
def op(monkeypatch):
    use_compiled_op(monkeypatch, kmoe.LIBRARY)
    use_compiled_op(monkeypatch, GGUF_LIBRARY)
    compiled_op_module(GGUF_LIBRARY)
    return compiled_op_module(kmoe.LIBRARY)


# (D, F, gate/up/down types, the shared expert's F and types): the 32-value types mixed by
# role and a narrower shared expert of another type, then the K-quants
CASES = {"q4_0-q8_0-q4_1": (64, 96, ("q4_0", "q8_0", "q4_1"), 32, ("q8_0",) * 3),
         "q4_k-q5_k-q6_k": (256, 256, ("q4_k", "q5_k", "q6_k"), 256, ("q6_k", "q4_k", "q4_k"))}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_rows", [1, 6, 33])
def test_the_gguf_layer_op_equals_the_block_op_grouping_and_a_float64_loop(op, case,
                                                                           num_rows):
    d, f, types, shared_f, shared_types = CASES[case]
    rng = np.random.default_rng(num_rows)
    num_experts, k = 6, 2
    experts = [expert_blocks(rng, d, f, types) for _ in range(num_experts)]
    router = rng.normal(0, 2 / np.sqrt(d), [d, num_experts]).astype(np.float32)  # logits ~ 2
    x = rng.normal(0, 1, [num_rows, d]).astype(np.float32)
    x[:, 0] = 4.0  # column 0 steers: expert 1 in every row, experts 4 and 5 in none
    router[0, 1], router[0, 4:] = 3.0, -3.0
    shared = (rng.normal(0, 0.3, [d, 1]).astype(np.float32),
              expert_blocks(rng, d, shared_f, shared_types))
    residual = rng.normal(0, 1, [num_rows, d]).astype(np.float32)
    expected, ids = routed_loop(x, router, k, True, experts, shared, residual)
    assert (ids == 1).any(-1).all() and not np.isin(ids, [4, 5]).any()
    graph = stock_tf(x, router, k, True, experts, shared) + residual
    scale = np.abs(expected - residual).max()
    for isa in ("auto", "scalar"):
        y, counts = kmoe.moe_gguf_layer(x, router, experts + [shared[1]], k, True, residual,
                                        shared[0], isa=isa)
        assert counts.numpy().tolist() == np.bincount(ids.ravel(), minlength=6).tolist()
        # the same q8 activations as the block op's: equal but for float summation order
        # and a rare activation rounding flipped by it
        np.testing.assert_allclose(y.numpy(), graph, rtol=0, atol=2e-3 * scale, err_msg=isa)
        # against float activations: the q8 rounding of x and of the hidden rows
        np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=0.05 * scale,
                                   err_msg=isa)


def test_experts_without_rows_are_not_read(op):
    """Expert 3's blocks hold NaN scales: read, they would turn every output NaN."""
    rng = np.random.default_rng(3)
    d, f = 64, 64
    experts = [expert_blocks(rng, d, f, ("q8_0", "q8_0", "q8_0")) for _ in range(4)]
    poisoned = [(kind, b.copy()) for kind, b in experts[3]]
    for _, b in poisoned:
        b.reshape(b.shape[0], -1, 34)[:, :, :2] = np.frombuffer(np.float16(np.nan).tobytes(),
                                                                np.uint8)
    router = np.zeros([d, 4], np.float32)
    router[0] = [1.0, 2.0, 0.0, -5.0]  # x[:, 0] > 0: experts 1 and 0 lead, 3 last
    x = np.abs(rng.normal(0, 1, [5, d])).astype(np.float32) + 0.5
    y, counts = kmoe.moe_gguf_layer(x, router, experts[:3] + [tuple(poisoned)], 2, True)
    assert counts.numpy().tolist() == [5, 5, 0, 0]
    assert np.isfinite(y.numpy()).all()


def test_bad_blocks_are_refused_by_name(op):
    rng = np.random.default_rng(4)
    d, f = 64, 64
    experts = [expert_blocks(rng, d, f, ("q4_0", "q4_0", "q4_0")) for _ in range(3)]
    x = np.zeros([2, d], np.float32)
    router = np.zeros([d, 3], np.float32)
    short = list(experts)
    short[1] = (experts[1][0], ("q4_0", experts[1][1][1][:, :-18]), experts[1][2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"up\[1\] must be \[64, 36\]"):
        kmoe.moe_gguf_layer(x, router, short, 2, True)
    wrong = list(experts)
    wrong[2] = (experts[2][0], experts[2][1], ("q8_0", experts[2][2][1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"down\[2\] must be \[64, 68\]"):
        kmoe.moe_gguf_layer(x, router, wrong, 2, True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the router has 4 experts but 3 up matrices"):
        kmoe.moe_gguf_layer(x, np.zeros([d, 4], np.float32), experts, 2, True)
