"""The paged attention op that stores a step's new K/V rows before it attends
(TokenservePagedWriteDecodeAttention), and the engine's step built on it: it must leave the
caches bit for bit as the scatters it replaces, read what it wrote, keep TF's snapshot
semantics for a dense read taken before it, and be ordered before later reads."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.compiled_ops import compiled_op_module, use_compiled_op
from support.tiny_models import greedy_by_full_forward, tiny
from tokenserve.kernels import paged_attention as pa

BITS = {tf.float32: tf.uint32, tf.bfloat16: tf.uint16, tf.float16: tf.uint16}


@pytest.fixture(scope="module")
def compiled():
    """Builds the op once (cached across runs); skips where it cannot be built."""
    return compiled_op_module(pa.LIBRARY)


@pytest.fixture
def op_on(monkeypatch):
    use_compiled_op(monkeypatch, pa.LIBRARY)


def bits(variable) -> np.ndarray:
    return tf.bitcast(tf.convert_to_tensor(variable), BITS[variable.dtype]).numpy()


def case(cache_dtype, q_dtype=tf.float32, h=4, hkv=2, dh=16, s=3, length=9, num_rows=64,
         seed=0):
    """Caches (two pairs of variables with the same contents), q, rows, lengths and new rows:
    each sequence's newest position is written and attended; three more rows that no
    sequence attends get a value float16 cannot hold, a NaN and -inf."""
    rng = np.random.default_rng(seed)
    width = hkv * dh
    start = rng.standard_normal((num_rows, width)).astype(np.float32)
    pairs = [tuple(tf.Variable(tf.cast(start * scale, cache_dtype), trainable=False)
                   for scale in (1.0, 0.5)) for _ in range(2)]
    order = rng.permutation(num_rows)
    rows = order[:s * length].reshape(s, length).astype(np.int32)
    lengths = np.array([length, 4, 1][:s], np.int32)
    newest = rows[np.arange(s), lengths - 1]
    unread = order[s * length:s * length + 3].astype(np.int32)
    write_rows = np.concatenate([newest, unread]).astype(np.int32)
    new_keys = rng.standard_normal((len(write_rows), width)).astype(np.float32)
    new_values = rng.standard_normal((len(write_rows), width)).astype(np.float32)
    new_keys[s, 0], new_keys[s + 1, 1], new_values[s + 2, 2] = 1e6, np.nan, -np.inf
    q = rng.standard_normal((s, h, dh)).astype(np.float32)
    cast = (lambda a: tf.cast(a, q_dtype))
    return pairs, cast(q), rows, lengths, cast(new_keys), cast(new_values), write_rows


@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (tf.float32, tf.float32), (tf.float32, tf.bfloat16), (tf.float32, tf.float16),
    (tf.bfloat16, tf.bfloat16)], ids=["f32", "f32-bf16cache", "f32-f16cache", "bf16"])
def test_write_then_attend_equals_scatter_then_read(compiled, op_on, q_dtype, cache_dtype):
    """The same caches, bit for bit, as the engine's scatters of the cast (and, for float16,
    clipped) rows; the same attention output, bit for bit: the op attends the rows it wrote."""
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(cache_dtype, q_dtype)
    (k1, v1), (k2, v2) = pairs

    @tf.function
    def fused():
        return pa.paged_write_decode_attention(q, k1, v1, rows, lengths, new_keys, new_values,
                                               write_rows, 0.25)

    @tf.function
    def scattered():
        for cache, new in ((k2, new_keys), (v2, new_values)):
            cache.scatter_update(tf.IndexedSlices(pa.to_cache_dtype(new, cache_dtype),
                                                  write_rows))
        return pa.paged_decode_attention(q, k2, v2, rows, lengths, 0.25)

    before = bits(k1)
    out, expected = fused(), scattered()
    assert out.dtype == q_dtype
    np.testing.assert_array_equal(tf.bitcast(out, BITS[q_dtype]).numpy(),
                                  tf.bitcast(expected, BITS[q_dtype]).numpy())
    np.testing.assert_array_equal(bits(k1), bits(k2))
    np.testing.assert_array_equal(bits(v1), bits(v2))
    assert (bits(k1) != before).any(axis=1).sum() == len(write_rows)  # every row written
    if cache_dtype == tf.float16:  # saturated, not an infinity
        assert float(k1[write_rows[3], 0]) == 65504.0
        assert float(v1[write_rows[5], 2]) == -65504.0
    assert np.isnan(float(k1[write_rows[4], 1]))


def test_write_attends_the_new_rows_against_float64(compiled, op_on):
    """Each sequence's newest position is the row written in the same call: the output is
    attention over the updated cache (float64 reference), not over the old row."""
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(tf.float32)
    keys, values = (pairs[0][0].numpy().copy(), pairs[0][1].numpy().copy())
    out = pa.paged_write_decode_attention(q, *pairs[0], rows, lengths, new_keys, new_values,
                                          write_rows, 0.25).numpy()
    keys[write_rows], values[write_rows] = new_keys.numpy(), new_values.numpy()
    q = q.numpy()
    s, h, dh = q.shape
    hkv = keys.shape[1] // dh
    for i in range(s):
        n = lengths[i]
        k = keys[rows[i, :n]].reshape(n, hkv, dh).astype(np.float64)
        v = values[rows[i, :n]].reshape(n, hkv, dh).astype(np.float64)
        for head in range(h):
            scores = k[:, head // (h // hkv)] @ q[i, head] * 0.25
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ v[:, head // (h // hkv)]
            np.testing.assert_allclose(out[i, head * dh:(head + 1) * dh], want, rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_queries_past_the_rows_come_out_zero(compiled, monkeypatch, path):
    """q with more queries than rows (a step's bucket padding after one decode group): the
    first S are the plain call's output, the rest zero rows; the caches are the same."""
    use_compiled_op(monkeypatch, pa.LIBRARY)
    if path == "fallback":
        monkeypatch.setenv(pa.MODE_ENV, "fallback")
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(tf.float16)
    padded_q = tf.concat([q, tf.ones([4] + q.shape[1:].as_list(), q.dtype)], 0)
    plain = pa.paged_write_decode_attention(q, *pairs[0], rows, lengths, new_keys,
                                            new_values, write_rows, 0.25).numpy()
    padded = tf.function(pa.paged_write_decode_attention)(
        padded_q, *pairs[1], rows, lengths, new_keys, new_values, write_rows, 0.25).numpy()
    assert padded.shape == (len(q) + 4, plain.shape[1])
    np.testing.assert_array_equal(padded[:len(q)], plain)
    assert not padded[len(q):].any()
    np.testing.assert_array_equal(bits(pairs[0][0]), bits(pairs[1][0]))


def test_a_dense_read_taken_before_stays_a_snapshot(compiled, op_on):
    """A tensor read from the variable before the write keeps its values (the op copies a
    buffer that is still referenced, as TF's sparse writes do); the variable has the rows."""
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(tf.float16)
    keys, values = pairs[0]
    snapshot = keys.read_value()
    held = tf.bitcast(snapshot, tf.uint16).numpy().copy()
    pa.paged_write_decode_attention(q, keys, values, rows, lengths, new_keys, new_values,
                                    write_rows, 0.25)
    np.testing.assert_array_equal(tf.bitcast(snapshot, tf.uint16).numpy(), held)
    assert (bits(keys) != held).any(axis=1).sum() == len(write_rows)
    # and after it, a dense read copies: a second write leaves that read alone too
    later = keys.read_value()
    held = tf.bitcast(later, tf.uint16).numpy().copy()
    pa.paged_write_decode_attention(q, keys, values, rows, lengths, new_keys * 2,
                                    new_values, write_rows, 0.25)
    np.testing.assert_array_equal(tf.bitcast(later, tf.uint16).numpy(), held)


def test_later_reads_are_ordered_after_the_write(compiled, op_on):
    """In a tf.function (the engine's step), automatic control dependencies put a later read
    of the same caches after the write op; no scatter and no dense read of a cache."""
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(tf.float32)
    keys, values = pairs[0]

    @tf.function
    def step():
        first = pa.paged_write_decode_attention(q, keys, values, rows, lengths, new_keys,
                                                new_values, write_rows, 0.25)
        return first, pa.paged_decode_attention(q, keys, values, rows, lengths, 0.25)

    first, second = step()
    np.testing.assert_array_equal(first.numpy(), second.numpy())  # both see the new rows
    ops = step.get_concrete_function().graph.get_operations()
    [write] = [op for op in ops if op.type == pa.WRITE_OP_TYPE]
    [read] = [op for op in ops if op.type == pa.OP_TYPE]
    assert write in read.control_inputs
    assert not {"ResourceScatterUpdate", "ReadVariableOp"} & {op.type for op in ops}


BAD = {
    "row past the end": dict(write_rows=[0, 64, 1, 2, 3, 4]),
    "negative row": dict(write_rows=[0, -1, 1, 2, 3, 4]),
    "new rows of the wrong width": dict(width=31),
    "fewer rows than write_rows": dict(count=5),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_are_refused_and_write_nothing(compiled, op_on, name):
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(tf.float32)
    keys, values = pairs[0]
    bad = BAD[name]
    if "write_rows" in bad:
        write_rows = np.array(bad["write_rows"], np.int32)
    if "width" in bad:
        new_keys = new_keys[:, :bad["width"]]
    if "count" in bad:
        new_values = new_values[:bad["count"]]
    before = (bits(keys), bits(values))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        pa.paged_write_decode_attention(q, keys, values, rows, lengths, new_keys, new_values,
                                        write_rows, 0.25)
    np.testing.assert_array_equal(bits(keys), before[0])
    np.testing.assert_array_equal(bits(values), before[1])


@pytest.mark.parametrize("cache_dtype", [tf.float32, tf.float16], ids=["f32", "f16cache"])
def test_fallback_stores_and_attends_the_same(compiled, monkeypatch, cache_dtype):
    """Without the compiled op (forced off) the same call scatters and then reads: the same
    caches and, within float rounding, the same output."""
    use_compiled_op(monkeypatch, pa.LIBRARY)
    pairs, q, rows, lengths, new_keys, new_values, write_rows = case(cache_dtype)
    out = pa.paged_write_decode_attention(q, *pairs[0], rows, lengths, new_keys, new_values,
                                          write_rows, 0.25)
    monkeypatch.setenv(pa.MODE_ENV, "fallback")
    fallback = pa.paged_write_decode_attention(q, *pairs[1], rows, lengths, new_keys,
                                               new_values, write_rows, 0.25)
    np.testing.assert_allclose(fallback.numpy(), out.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bits(pairs[0][0]), bits(pairs[1][0]))
    np.testing.assert_array_equal(bits(pairs[0][1]), bits(pairs[1][1]))


# --------------------------------------------------------------------------------------------
# The engine's steps


def _cache_consumers(step_graph, handles) -> list[str]:
    """The op types that take a cache variable's handle inside a traced step."""
    internal = {id(inner) for outer, inner in step_graph.captures
                if any(outer is handle for handle in handles)}
    return [op.type for op in step_graph.get_operations()
            if any(id(t) in internal for t in op.inputs)]


@pytest.mark.parametrize("name,kv_dtype,batch_sizes", [
    ("tiny-gpt2", "float16", ()), ("tiny-gpt2", "float32", ()),
    ("tiny-llama", "float16", ()), ("tiny-llama", "float16", (4,))])
def test_engine_steps_store_rows_in_the_attention_op(compiled, op_on, tokenizer, name,
                                                     kv_dtype, batch_sizes):
    """Every decode and prefill step of a tiny GPT-2 (and a tiny Llama: RoPE, grouped
    kv heads) stores each layer's new rows with the
    write op, once a layer, and touches the caches only through the attention ops: no
    scatter, no dense read, no XLA (the step's dense programs never take a cache); and the
    engine's greedy tokens are those of full forward passes."""
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.engine.step.packing import bucket_size
    from tokenserve.sampling import SamplingParams

    model, config = tiny(name, tokenizer)
    # batch_sizes (TF Serving's allowed_batch_sizes) pads two decoding sequences to four
    runner = ModelRunner(model, config, EngineConfig(block_size=4, precision="float32",
                                                     kv_cache_dtype=kv_dtype,
                                                     batch_sizes=batch_sizes,
                                                     max_num_seqs=4))
    engine = LLMEngine(runner, tokenizer, runner.engine_config)
    # two decoding sequences: padded to four rows where batch_sizes says so
    assert bucket_size(2, runner.engine_config.batch_sizes, only_decode=True,
                       xla=False) == (4 if batch_sizes else 2)
    prompts = [[5, 9, 11, 3, 7], [8, 2, 2, 6, 1, 4, 9, 10, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(prompt, params, f"r{i}"))
    while engine.has_work:
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == greedy_by_full_forward(model, prompt, 6)

    step = runner.step
    handles = [v.handle for pair in step.caches for v in pair]
    layers = len(step.caches)
    traced = [fc.concrete.graph for fc in step._concrete.values()]
    assert traced
    for graph in traced:
        consumers = _cache_consumers(graph, handles)
        assert set(consumers) <= {pa.WRITE_OP_TYPE, pa.OP_TYPE}, consumers
        ops = [op.type for op in graph.get_operations()]
        assert ops.count(pa.WRITE_OP_TYPE) == layers
        assert "ResourceScatterUpdate" not in ops
