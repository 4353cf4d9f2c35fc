"""The router and the grouped experts (the compiled ops and the stock-TF grouping) against a
plain per-token loop in float64, with experts that get no rows and one that gets every row;
bad expert ids and shapes refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module, use_compiled_op
from tokenserve.kernels import moe as kmoe
from tokenserve.model.moe import expert_counts, grouped_experts, route, shared_expert

D, F, E, K = 48, 40, 6, 2


def experts(rng, num_experts=E, width=F):
    """float32 ([D, 2F] up, [F, D] down) per expert, weights large enough to matter."""
    return [(rng.normal(0, 0.2, [D, 2 * width]).astype(np.float32),
             rng.normal(0, 0.2, [width, D]).astype(np.float32)) for _ in range(num_experts)]


def per_token_loop(x, expert_ids, gates, weights, residual=None):
    """y[r] = residual[r] + sum_j gates[r, j] * expert(x[r]), row by row in float64."""
    x = x.astype(np.float64)
    y = np.zeros_like(x) if residual is None else residual.astype(np.float64).copy()
    for r in range(len(x)):
        for j in range(expert_ids.shape[1]):
            up, down = (w.astype(np.float64) for w in weights[expert_ids[r, j]])
            z = x[r] @ up
            gate, value = np.split(z, 2)  # SwiGLU's halves
            y[r] += gates[r, j] * ((gate / (1 + np.exp(-gate)) * value) @ down)
    return y


def routing_cases(rng, num_rows):
    """(name, expert ids [M, K]): random choices; one expert in every row with experts 4 and
    5 never chosen; every row on the same two experts."""
    spread = np.stack([rng.choice(E, K, replace=False) for _ in range(num_rows)]).astype(np.int32)
    one = np.stack([[2, rng.choice([0, 1, 3])] for _ in range(num_rows)]).astype(np.int32)
    same = np.tile(np.array([[5, 0]], np.int32), [num_rows, 1])
    return [("spread", spread), ("expert-2-everywhere", one), ("two-experts", same)]


@pytest.fixture
def op(monkeypatch):
    use_compiled_op(monkeypatch, kmoe.LIBRARY)
    return compiled_op_module(kmoe.LIBRARY)


@pytest.mark.parametrize("num_rows", [1, 3, 9, 40])
def test_grouped_experts_op_and_graph_path_equal_a_per_token_loop(op, num_rows):
    rng = np.random.default_rng(num_rows)
    weights = experts(rng)
    x = rng.normal(0, 1, [num_rows, D]).astype(np.float32)
    residual = rng.normal(0, 1, [num_rows, D]).astype(np.float32)
    for name, ids in routing_cases(rng, num_rows):
        gates = rng.uniform(0.1, 1, [num_rows, K]).astype(np.float32)
        expected = per_token_loop(x, ids, gates, weights, residual)
        ups, downs = [w[0] for w in weights], [w[1] for w in weights]
        for isa in ("auto", "scalar"):
            got = kmoe.moe_experts(x, ids, gates, ups, downs, residual, isa=isa).numpy()
            np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-5, err_msg=name)
        graph = grouped_experts(tf.constant(x), ids, gates,
                                [{"up": {"kernel": u}, "down": {"kernel": d}} for u, d in weights])
        np.testing.assert_allclose(graph.numpy() + residual, expected, atol=2e-4, rtol=1e-5,
                                   err_msg=name)
        # no residual, bfloat16 weights: the op widens them as it reads, float32 arithmetic
        bf16 = [(u.astype(tf.bfloat16.as_numpy_dtype), d.astype(tf.bfloat16.as_numpy_dtype))
                for u, d in weights]
        got = kmoe.moe_experts(x, ids, gates, [w[0] for w in bf16], [w[1] for w in bf16]).numpy()
        np.testing.assert_allclose(got, per_token_loop(x, ids, gates, bf16), atol=2e-4,
                                   rtol=1e-5, err_msg=name)


def test_experts_of_different_widths_as_the_shared_expert_needs(op):
    rng = np.random.default_rng(7)
    weights = experts(rng, 3) + experts(rng, 1, width=24)  # a narrower fourth expert
    x = rng.normal(0, 1, [5, D]).astype(np.float32)
    ids = np.array([[0, 3], [1, 3], [2, 3], [0, 3], [1, 3]], np.int32)
    gates = rng.uniform(0, 1, [5, 2]).astype(np.float32)
    got = kmoe.moe_experts(x, ids, gates, [w[0] for w in weights], [w[1] for w in weights])
    np.testing.assert_allclose(got.numpy(), per_token_loop(x, ids, gates, weights), atol=2e-4)


def test_the_router_is_a_softmax_top_k_renormalised_or_not():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, [16, E]).astype(np.float32)
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)[:, :K]
    top = np.take_along_axis(probs, order, -1)
    for normalize, want in ((False, top), (True, top / top.sum(-1, keepdims=True))):
        ids, gates = route(tf.constant(logits), K, normalize)
        assert (ids.numpy() == order).all()
        np.testing.assert_allclose(gates.numpy(), want, rtol=1e-6)
    counts = expert_counts(tf.constant(order.astype(np.int32)), E).numpy()
    assert counts.tolist() == np.bincount(order.ravel(), minlength=E).tolist()


def test_bad_expert_ids_and_shapes_are_refused_by_name(op):
    rng = np.random.default_rng(0)
    weights = experts(rng, 2)
    ups, downs = [w[0] for w in weights], [w[1] for w in weights]
    x = np.zeros([2, D], np.float32)
    gates = np.ones([2, 2], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"expert_ids\[1, 0\] = 2 is outside \[0, 2\)"):
        kmoe.moe_experts(x, np.array([[0, 1], [2, 0]], np.int32), gates, ups, downs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"down\[1\] must be \[40, 48\]"):
        kmoe.moe_experts(x, np.array([[0, 1], [1, 0]], np.int32), gates, ups,
                         [downs[0], downs[1][:, :8]])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"gates must be \[2, 2\]"):
        kmoe.moe_experts(x, np.array([[0, 1], [1, 0]], np.int32), gates[:, :1], ups, downs)


def test_fallback_is_none_so_the_caller_takes_the_graph_path(monkeypatch):
    monkeypatch.setenv(kmoe.LIBRARY.mode_env, "fallback")
    x = np.zeros([1, D], np.float32)
    assert kmoe.moe_experts(x, np.zeros([1, 1], np.int32), np.ones([1, 1], np.float32),
                            [np.zeros([D, 2 * F], np.float32)],
                            [np.zeros([F, D], np.float32)]) is None


def test_experts_without_rows_are_not_read(op):
    """Experts 4 and 5 hold NaN weights and no row chooses them: had either path read them
    (a matmul over them, or a copy into a stacked tensor), NaN would reach some output."""
    rng = np.random.default_rng(11)
    weights = experts(rng)
    for e in (4, 5):
        weights[e] = tuple(np.full_like(w, np.nan) for w in weights[e])
    x = rng.normal(0, 1, [7, D]).astype(np.float32)
    ids = np.stack([[2, rng.choice([0, 1, 3])] for _ in range(7)]).astype(np.int32)
    gates = rng.uniform(0.1, 1, [7, K]).astype(np.float32)
    expected = per_token_loop(x, ids, gates, weights)
    got = kmoe.moe_experts(x, ids, gates, [w[0] for w in weights], [w[1] for w in weights])
    graph = grouped_experts(tf.constant(x), ids, gates,
                            [{"up": {"kernel": u}, "down": {"kernel": d}} for u, d in weights])
    for y in (got.numpy(), graph.numpy()):
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, expected, atol=2e-4, rtol=1e-5)


def test_the_op_counts_the_rows_each_expert_ran_on(op):
    rng = np.random.default_rng(5)
    weights = experts(rng)
    ids = np.array([[2, 0], [2, 3], [5, 2]], np.int32)
    _, counts = kmoe.moe_experts(rng.normal(0, 1, [3, D]).astype(np.float32), ids,
                                 np.ones([3, 2], np.float32), [w[0] for w in weights],
                                 [w[1] for w in weights], with_counts=True)
    assert counts.numpy().tolist() == [1, 0, 3, 1, 0, 1]


# ---- the whole layer in one op: the router's softmax, top-k and renormalisation inside ----

def routed_loop(x, router, k, normalize, weights, shared=None, residual=None):
    """The router and the experts row by row in float64: softmax of x @ router, the k largest
    probabilities (a tie to the lower expert index, as tf.math.top_k), renormalised when
    `normalize`; shared: (gate [D, 1], up, down), scaled by sigmoid(x @ gate). Returns (y,
    expert ids [M, k])."""
    logits = x.astype(np.float64) @ router.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    gates = np.take_along_axis(probs, ids, -1)
    if normalize:
        gates /= gates.sum(-1, keepdims=True)
    y = per_token_loop(x, ids, gates, weights, residual)
    if shared is not None:
        gate, up, down = shared
        scale = 1 / (1 + np.exp(-(x.astype(np.float64) @ gate.astype(np.float64))))
        y += per_token_loop(x, np.zeros([len(x), 1], np.int32), scale, [(up, down)])
    return y, ids


def stock_tf(x, router, k, normalize, weights, shared=None):
    """model/moe.py's stock-TF routing and grouping, the engine's reference path."""
    ids, gates = route(tf.constant(x) @ router, k, normalize)
    y = grouped_experts(tf.constant(x), ids, gates,
                        [{"up": {"kernel": u}, "down": {"kernel": d}} for u, d in weights])
    if shared is not None:
        gate, up, down = shared
        y += shared_expert(tf.constant(x), {"gate": {"kernel": gate}, "up": {"kernel": up},
                                            "down": {"kernel": down}})
    return y.numpy(), ids.numpy()


@pytest.mark.parametrize("num_rows", [1, 9, 40])
@pytest.mark.parametrize("k, normalize, with_shared", [(2, True, False), (3, False, True),
                                                       (1, False, False)])
def test_the_layer_op_routes_and_mixes_as_a_per_token_loop_and_the_stock_tf_path(
        op, num_rows, k, normalize, with_shared):
    rng = np.random.default_rng(num_rows * 10 + k)
    num_experts = 8
    weights = experts(rng, num_experts)
    router = rng.normal(0, 0.5, [D, num_experts]).astype(np.float32)
    shared = None
    if with_shared:  # a narrower shared expert and its gate
        up, down = experts(rng, 1, width=24)[0]
        shared = (rng.normal(0, 0.3, [D, 1]).astype(np.float32), up, down)
    x = rng.normal(0, 1, [num_rows, D]).astype(np.float32)
    residual = rng.normal(0, 1, [num_rows, D]).astype(np.float32)
    expected, ids = routed_loop(x, router, k, normalize, weights, shared, residual)
    ups, downs = [w[0] for w in weights], [w[1] for w in weights]
    if shared is not None:
        ups, downs = ups + [shared[1]], downs + [shared[2]]
    for isa in ("auto", "scalar"):
        y, counts = kmoe.moe_layer(x, router, ups, downs, k, normalize, residual,
                                   None if shared is None else shared[0], isa=isa)
        np.testing.assert_allclose(y.numpy(), expected, atol=2e-4, rtol=1e-5, err_msg=isa)
        assert counts.numpy().tolist() == np.bincount(ids.ravel(), minlength=8).tolist()
    graph, graph_ids = stock_tf(x, router, k, normalize, weights, shared)
    assert (graph_ids == ids).all()
    np.testing.assert_allclose(graph + residual, expected, atol=2e-4, rtol=1e-5)


def test_a_tie_in_the_top_k_goes_to_the_lower_expert_index_as_tf_top_k(op):
    """Experts 1, 4 and 6 share one router column, scaled so they lead every row: top-1
    takes expert 1, top-2 experts 1 and 4, never 6, whichever order the weights differ."""
    rng = np.random.default_rng(21)
    weights = experts(rng, 8)
    router = rng.normal(0, 0.1, [D, 8]).astype(np.float32)
    x = rng.normal(0, 1, [12, D]).astype(np.float32)
    x[:, 0] = 3.0
    router[:, 1] = rng.normal(0, 0.1, D)
    router[0, 1] = 2.0
    router[:, 4] = router[:, 6] = router[:, 1]
    ups, downs = [w[0] for w in weights], [w[1] for w in weights]
    for k, chosen in ((1, [1]), (2, [1, 4])):
        expected, ids = routed_loop(x, router, k, True, weights)
        assert (np.sort(ids, -1) == chosen).all()
        y, counts = kmoe.moe_layer(x, router, ups, downs, k, True)
        assert counts.numpy().tolist() == [12 if e in chosen else 0 for e in range(8)]
        np.testing.assert_allclose(y.numpy(), expected, atol=2e-4, rtol=1e-5)
        graph, graph_ids = stock_tf(x, router, k, True, weights)
        assert (np.sort(graph_ids, -1) == chosen).all()
        np.testing.assert_allclose(y.numpy(), graph, atol=2e-5, rtol=1e-5)


def test_the_layer_op_refuses_mismatched_experts_by_name(op):
    rng = np.random.default_rng(2)
    weights = experts(rng, 3)
    ups, downs = [w[0] for w in weights], [w[1] for w in weights]
    x = np.zeros([2, D], np.float32)
    router = np.zeros([D, 4], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the router has 4 experts but 3 up matrices"):
        kmoe.moe_layer(x, router, ups, downs, 2, True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k = 4 exceeds the router's 3"):
        kmoe.moe_layer(x, router[:, :3], ups, downs, 4, True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"router must be \[48, E\]"):
        kmoe.moe_layer(x, router[:8], ups, downs, 2, True)
