"""TokenserveSplitRope: a fused QKV projection's output split into q, k and v with RoPE
applied, in one op, bit for bit as the graph ops it replaces; and the engine's fused steps
built on it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module, use_compiled_op
from support.tiny_models import greedy_by_full_forward, tiny
from tokenserve.kernels import dense as kd
from tokenserve.model.layers import apply_rope, head_norm, rope_angles


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(kd.LIBRARY)


@pytest.fixture
def op_on(monkeypatch):
    use_compiled_op(monkeypatch, kd.LIBRARY)


def inputs(h, hkv, dh, n, seed=0, theta=10000.0):
    rng = np.random.default_rng(seed)
    qkv = tf.constant(rng.standard_normal((n, (h + 2 * hkv) * dh)).astype(np.float32) * 4)
    positions = tf.constant([rng.integers(0, 4096, n)], tf.int32)
    cos, sin = rope_angles(positions, dh, theta, tf.float32)           # [1, N, 1, Dh]
    return qkv, (cos, sin), (tf.reshape(cos, [n, dh]), tf.reshape(sin, [n, dh]))


@pytest.mark.parametrize("h,hkv,dh,n", [(9, 3, 64, 5), (4, 4, 16, 1), (8, 1, 32, 33),
                                        (2, 2, 2, 3)])
def test_equals_the_graph_ops_bit_for_bit(compiled, op_on, h, hkv, dh, n):
    """The same bits as the step's graph path (split, reshape, apply_rope on q and k), traced
    and eager: each product and the sum rounded separately, no fused multiply-add."""
    qkv, rotary4, rotary = inputs(h, hkv, dh, n)
    width = hkv * dh

    @tf.function
    def graph_path(qkv):
        q, k, v = tf.split(qkv, [h * dh, width, width], -1)
        q = apply_rope(tf.reshape(q, [-1, h, dh])[None], *rotary4)[0]
        k = tf.reshape(apply_rope(tf.reshape(k, [1, -1, hkv, dh]), *rotary4), [-1, width])
        return q, k, v

    got = kd.split_rope(qkv, h, hkv, dh, rotary)
    traced = tf.function(lambda t: kd.split_rope(t, h, hkv, dh, rotary))(qkv)
    for mine, theirs, again in zip(got, graph_path(qkv), traced):
        assert mine.shape == theirs.shape
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
        np.testing.assert_array_equal(again.numpy(), theirs.numpy())
    # and it does rotate: position-dependent, not a plain split
    plain = kd.split_rope(qkv, h, hkv, dh)
    assert not np.array_equal(plain[0].numpy(), got[0].numpy())
    np.testing.assert_array_equal(plain[2].numpy(), got[2].numpy())  # v is never rotated


def test_fallback_equals_apply_rope():
    """The pure-TF path (where no op is compiled) rotates as the model's apply_rope does."""
    qkv, rotary4, rotary = inputs(6, 2, 16, 4)
    q, k, v = kd.split_rope_fallback(qkv, 6, 2, 16, rotary)
    want_q, want_k, want_v = tf.split(qkv, [96, 32, 32], -1)
    np.testing.assert_array_equal(
        q.numpy(), apply_rope(tf.reshape(want_q, [1, -1, 6, 16]), *rotary4)[0].numpy())
    np.testing.assert_array_equal(
        k.numpy(), tf.reshape(apply_rope(tf.reshape(want_k, [1, -1, 2, 16]), *rotary4),
                              [-1, 32]).numpy())
    np.testing.assert_array_equal(v.numpy(), want_v.numpy())


def test_without_rotary_it_is_a_split(compiled, op_on):
    qkv, _, _ = inputs(6, 2, 8, 4)
    q, k, v = kd.split_rope(qkv, 6, 2, 8)
    expected = tf.split(qkv, [48, 16, 16], -1)
    np.testing.assert_array_equal(q.numpy(), tf.reshape(expected[0], [-1, 6, 8]).numpy())
    np.testing.assert_array_equal(k.numpy(), expected[1].numpy())
    np.testing.assert_array_equal(v.numpy(), expected[2].numpy())


def test_fallback_is_the_same(compiled, op_on, monkeypatch):
    qkv, _, rotary = inputs(9, 3, 64, 5)
    got = kd.split_rope(qkv, 9, 3, 64, rotary)
    monkeypatch.setenv("TOKENSERVE_DENSE_KERNEL", "fallback")
    for mine, theirs in zip(got, kd.split_rope(qkv, 9, 3, 64, rotary)):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize("case", ["qkv too narrow", "cos rows", "cos without sin", "odd Dh"])
def test_bad_inputs(compiled, op_on, case):
    qkv, _, (cos, sin) = inputs(4, 2, 8, 3)
    h, hkv, dh = 4, 2, 8
    if case == "qkv too narrow":
        qkv = qkv[:, :-1]
    elif case == "cos rows":
        cos, sin = cos[:2], sin[:2]
    elif case == "cos without sin":
        sin = tf.zeros([0], tf.float32)
    else:
        h, hkv, dh, qkv = 4, 2, 7, qkv[:, :56]
        cos, sin = cos[:, :7], sin[:, :7]
    empty = tf.zeros([0], tf.float32)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        compiled.tokenserve_split_rope(qkv, cos, sin, empty, empty, num_heads=h,
                                       num_kv_heads=hkv, head_dim=dh)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("h,hkv,dh,rotary_dim,n", [(4, 2, 16, 8, 3), (6, 3, 32, 32, 5),
                                                   (2, 1, 64, 16, 1), (4, 4, 16, 0, 2)])
def test_qk_norm_and_a_partial_rotary_equal_the_graph_ops(compiled, op_on, qk_norm, h, hkv,
                                                          dh, rotary_dim, n):
    """QK-norm (each q and k head RMS-normed before RoPE: Qwen3, Gemma 3) and a partial
    rotary (only each head's first R dimensions turn: Phi-3's kind) in the one op, as the
    graph path's head_norm and apply_rope compute them (the norm's sum in double: within
    float rounding); rotary_dim 0: QK-norm without RoPE."""
    rng = np.random.default_rng(h + dh)
    qkv = tf.constant(rng.standard_normal((n, (h + 2 * hkv) * dh)).astype(np.float32) * 4)
    width = hkv * dh
    rotary4 = rotary = None
    if rotary_dim:
        positions = tf.constant([rng.integers(0, 4096, n)], tf.int32)
        rotary4 = rope_angles(positions, rotary_dim, 10000.0, tf.float32)  # [1, N, 1, R]
        rotary = tuple(tf.reshape(t, [n, rotary_dim]) for t in rotary4)
    norms = {}
    if qk_norm:
        norms = {name: tf.constant(1 + 0.5 * rng.standard_normal(dh).astype(np.float32))
                 for name in ("q_norm", "k_norm")}

    def graph_path(qkv):
        q, k, v = tf.split(qkv, [h * dh, width, width], -1)
        q, k = tf.reshape(q, [1, -1, h, dh]), tf.reshape(k, [1, -1, hkv, dh])
        if qk_norm:
            q = head_norm(q, {"scale": norms["q_norm"]}, 1e-6)
            k = head_norm(k, {"scale": norms["k_norm"]}, 1e-6)
        if rotary4 is not None:
            q, k = apply_rope(q, *rotary4), apply_rope(k, *rotary4)
        return q[0], tf.reshape(k, [-1, width]), v

    want = graph_path(qkv)
    got = kd.split_rope(qkv, h, hkv, dh, rotary, eps=1e-6, **norms)
    fallback = kd.split_rope_fallback(qkv, h, hkv, dh, rotary, eps=1e-6, **norms)
    for mine, again, theirs in zip(got, fallback, want):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(again.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)
    if rotary_dim and rotary_dim < dh and not qk_norm:  # the dimensions past R pass as they are
        q_in = tf.reshape(qkv[:, :h * dh], [n, h, dh])[:, :, rotary_dim:]
        np.testing.assert_array_equal(got[0].numpy()[:, :, rotary_dim:], q_in.numpy())
    if qk_norm:  # the scales are read: without them the heads differ
        plain = kd.split_rope(qkv, h, hkv, dh, rotary)
        assert not np.allclose(plain[0].numpy(), got[0].numpy(), atol=1e-2)
        np.testing.assert_array_equal(plain[2].numpy(), got[2].numpy())  # v: never normed


def test_qk_norm_and_rotary_width_refusals(compiled, op_on):
    qkv, _, (cos, sin) = inputs(4, 2, 8, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="q_norm and k_norm must both be"):
        kd.split_rope(qkv, 4, 2, 8, (cos, sin), q_norm=tf.ones([8]), k_norm=tf.ones([7]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="R even, at most head_dim 8"):
        kd.split_rope(qkv, 4, 2, 8, (cos[:, :3], sin[:, :3]))


def test_llama_engine_steps_use_it(compiled, op_on, tokenizer):
    """A tiny Llama's fused decode and prefill steps split and rotate with one op a layer
    (no graph RoPE left: no Neg), and the engine's greedy tokens are those of full forward
    passes; GPT-2 (no RoPE) takes the same op as a plain split."""
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.sampling import SamplingParams

    for name in ("tiny-llama", "tiny-gpt2"):
        model, config = tiny(name, tokenizer)
        runner = ModelRunner(model, config, EngineConfig(block_size=4, precision="float32",
                                                         max_fused_dense_tokens=64))
        engine = LLMEngine(runner, tokenizer, runner.engine_config)
        prompts = [[5, 9, 11, 3, 7], [8, 2, 2, 6, 1, 4, 9, 10, 12, 30, 31, 2]]
        params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
        got = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.make_request(prompt, params, f"r{i}"))
        while engine.has_work:
            for output in engine.step():
                got.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        for i, prompt in enumerate(prompts):
            assert got[f"r{i}"] == greedy_by_full_forward(model, prompt, 7), name
        graphs = [fc.concrete.graph for key, fc in runner.step._concrete.items() if key[2]]
        assert graphs, "no fused step ran"
        for graph in graphs:
            ops = [op.type for op in graph.get_operations()]
            assert ops.count("TokenserveSplitRope") == len(runner.step.caches), name
            assert "Neg" not in ops
