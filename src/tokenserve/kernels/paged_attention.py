"""Fused decode attention over the paged KV cache, usable in graph-mode tf.function (no XLA).

The engine keeps each layer's keys and values in two resource variables of [R, Hkv * Dh]
(R = num_blocks * block_size rows). The graph path gathers the live rows into
[S, L, Hkv * Dh] copies and runs batched matmuls and a softmax; `TokenservePagedDecodeAttention`
(`paged_attention.cc`) instead reads the rows in place from the variables (under their
shared lock, like ResourceGather; never densely, so no copy of the cache) and does scores,
float32 softmax and the weighted sum of the values per sequence (split into spans of its kv
heads when there are few sequences) on TF's intra-op threads, with AVX2+FMA where the CPU has
it. benchmarks/experiments/paged_attention.py: 1.7-2x faster than the graph path at batch 1,
~3x at 32 sequences (GPT-2-small, 2-core EPYC).

    out = paged_decode_attention(q, key_cache, value_cache, rows, lengths, 1 / sqrt(Dh))
    # q [S, H, Dh]; caches: tf.Variable [R, Hkv*Dh] (or their handles); rows int32 [S, L];
    # lengths int32 [S] (positions 0..lengths-1 are attended; 0 gives zeros) -> [S, H*Dh]

`paged_write_decode_attention` (`TokenservePagedWriteDecodeAttention`) first stores a step's
new rows into the caches, then attends: the engine's step calls it once a layer in place of
a cast, a clip and a scatter per cache.

The cache may be stored in fewer bits than q: a float32 step over a bfloat16 or float16
cache (half the memory) widens each row to float32 as it reads it, exactly, in the op and in
the fallback alike; the math after that is the float32 cache's.

Ordering against the cache writes: the op's shared lock on the variables does not order it
against `scatter_update` (ResourceScatterUpdate writes float/bfloat16 under a shared lock
too), the graph must. Inside a tf.function, automatic control dependencies give every op
that takes a variable's handle a control input on the last earlier write to that variable in
program order, so a step that scatters a layer's new rows and then calls this op (passing the
same variables, or their `.handle`) reads the updated rows with no explicit control
dependency (tests/kernels/test_paged_attention.py checks the control inputs). A graph built without
automatic control dependencies (tf.compat.v1 graph mode) would need
`tf.control_dependencies([key_scatter, value_scatter])` around the call. The op is registered
as a read-only resource op there (as ResourceGather is), so several reads of the same cache
(decode groups, prefill gathers) are not serialised against each other.

The op is compiled from source on first use (tokenserve.kernels.build). Without a compiler,
or with TOKENSERVE_PAGED_ATTENTION_KERNEL=fallback or TOKENSERVE_KERNELS=fallback, a pure-TF
fallback with the same semantics runs (ResourceGather + matmuls + masked softmax).

`python -m tokenserve.kernels.paged_attention` builds the op and prints kernel_status().
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tokenserve.kernels import build as kbuild

log = logging.getLogger("tokenserve.kernels")

LIBRARY = kbuild.LIBRARIES["paged_attention"]
MODE_ENV = LIBRARY.mode_env  # TOKENSERVE_PAGED_ATTENTION_KERNEL
OP_TYPE = "TokenservePagedDecodeAttention"

WRITE_OP_TYPE = "TokenservePagedWriteDecodeAttention"  # a write: ordered as one

try:  # a read, not a write, for tf.function's automatic control dependencies (private API)
    from tensorflow.python.framework import auto_control_deps_utils as _acd

    _acd.register_read_only_resource_op(OP_TYPE)
except (ImportError, AttributeError):  # pragma: no cover - then it is ordered as a write
    pass


def paged_decode_attention(q, key_cache, value_cache, rows, lengths, scale: float,
                           cache_dtype=None, softcap: float = 0.0) -> tf.Tensor:
    """Decode attention of q [S, H, Dh] over cache rows -> [S, H * Dh] in q's dtype.

    key_cache, value_cache: tf.Variable (or a resource handle tensor) of [R, Hkv * Dh] in q's
    dtype, or in bfloat16 or float16 under a float32 q (`cache_dtype`: needed for handles
    only, default q's dtype); head h reads kv head h // (H // Hkv).
    rows: int32 [S, L], the cache row of each context position; every entry must be a valid
    row (padding: e.g. 0), else InvalidArgumentError.
    lengths: int32 [S], positions 0 .. lengths[s] - 1 are attended to; 0 gives zeros.
    scale: the score scale (a Python float, usually 1 / sqrt(Dh)).
    softcap: Gemma 2's cap on the scaled scores (softcap * tanh(s / softcap)); 0: none.

    Uses the compiled op when it is available, else `paged_decode_attention_fallback`. Works
    eagerly and inside tf.function (the choice is made when the graph is traced).
    """
    op = LIBRARY.module()
    if op is None:
        return paged_decode_attention_fallback(q, key_cache, value_cache, rows, lengths, scale,
                                               cache_dtype, softcap)
    return _call(op, q, key_cache, value_cache, rows, lengths, scale,
                 cache_dtype=cache_dtype, softcap=softcap)


def paged_write_decode_attention(q, key_cache, value_cache, rows, lengths, new_keys,
                                 new_values, write_rows, scale: float,
                                 softcap: float = 0.0) -> tf.Tensor:
    """Writes new rows into the caches, then paged_decode_attention over them, as one op.

    new_keys, new_values: [N, Hkv * Dh] in q's dtype, stored at cache rows write_rows int32
    [N] (converted to the cache's dtype as `to_cache_dtype` converts); the rest as
    paged_decode_attention. A decode step's every layer otherwise runs a cast (and for a
    float16 cache a clip) and a ResourceScatterUpdate per cache before its attention: eight
    small ops a layer, each starting on caches the weight streams have just flushed. The op
    holds both variables' locks exclusively while it writes and attends; like
    ResourceScatterUpdate it replaces a buffer that another tensor still references by a
    copy first, and puts the variables in copy-on-read mode.

    q may hold more queries than rows' S: the first S are attended, and the rest (a step's
    bucket padding) come out as zero rows, so a step with one decode group needs no split
    of q and no concat after.

    key_cache, value_cache: tf.Variable (their dtype is the cache's). Without the compiled
    op: `scatter_update` of each cache, then paged_decode_attention (the same values)."""
    q = tf.convert_to_tensor(q)
    op = LIBRARY.module()
    if op is None:
        return paged_write_decode_attention_fallback(q, key_cache, value_cache, rows, lengths,
                                                     new_keys, new_values, write_rows, scale,
                                                     softcap)
    stored = _cache_dtype(key_cache, value_cache, q.dtype)
    return op.tokenserve_paged_write_decode_attention(
        q, _handle(key_cache), _handle(value_cache), tf.cast(rows, tf.int32),
        tf.cast(lengths, tf.int32), tf.cast(new_keys, q.dtype), tf.cast(new_values, q.dtype),
        tf.cast(write_rows, tf.int32), scale=float(scale), softcap=float(softcap),
        Tcache=stored)


def paged_write_decode_attention_fallback(q, key_cache, value_cache, rows, lengths,
                                          new_keys, new_values, write_rows,
                                          scale: float, softcap: float = 0.0) -> tf.Tensor:
    """paged_write_decode_attention as graph ops: a scatter per cache, the attention of the
    first S queries, zero rows for the rest."""
    q = tf.convert_to_tensor(q)
    scatter_rows(key_cache, value_cache, new_keys, new_values, write_rows)
    num_seqs, shape = tf.shape(rows)[0], tf.shape(q)
    out = paged_decode_attention(q[:num_seqs], key_cache, value_cache, rows, lengths, scale,
                                 softcap=softcap)
    return tf.concat([out, tf.zeros([shape[0] - num_seqs, shape[1] * shape[2]], q.dtype)], 0)


def scatter_rows(key_cache, value_cache, new_keys, new_values, write_rows) -> None:
    """new_keys, new_values [N, Hkv * Dh] into rows write_rows [N] of the cache variables, in
    their dtype (`to_cache_dtype`): a ResourceScatterUpdate per cache, the graph path's
    write."""
    for cache, new in ((key_cache, new_keys), (value_cache, new_values)):
        cache.scatter_update(tf.IndexedSlices(to_cache_dtype(new, cache.dtype), write_rows))


def to_cache_dtype(rows, dtype) -> tf.Tensor:
    """New K/V rows in the cache's dtype; a float16 cache saturates at +-65504 (no inf from a
    rare large value) instead of overflowing."""
    if tf.as_dtype(dtype) == tf.float16:
        rows = tf.clip_by_value(rows, -65504.0, 65504.0)
    return tf.cast(rows, dtype)


def compiled_paged_decode_attention(q, key_cache, value_cache, rows, lengths, scale: float,
                                    isa: str = "auto", kv_heads_per_item: int = 0,
                                    cache_dtype=None, softcap: float = 0.0) -> tf.Tensor:
    """The compiled op with its kernel choices exposed (tests and benchmarks).

    isa: "auto" (AVX2+FMA where the CPU has it) or "scalar" (the portable path).
    kv_heads_per_item: how many kv heads of a sequence one parallel work item takes (it reads
    that many heads' values of each row contiguously); 0 (default) picks all of them unless
    that leaves fewer than 4 items per intra-op thread. Must divide Hkv.
    Raises RuntimeError if the op is unavailable.
    """
    loaded = LIBRARY.load()
    if isinstance(loaded, str):
        raise RuntimeError(f"paged attention op unavailable: {loaded}")
    return _call(loaded[0], q, key_cache, value_cache, rows, lengths, scale, isa,
                 kv_heads_per_item, cache_dtype, softcap)


CACHE_DTYPES = (tf.float32, tf.bfloat16, tf.float16)


def _cache_dtype(key_cache, value_cache, q_dtype: tf.DType, cache_dtype=None) -> tf.DType:
    """The dtype both caches hold: the variables' own, else `cache_dtype`, else q's."""
    dtypes = {c.dtype for c in (key_cache, value_cache) if isinstance(c, tf.Variable)}
    if cache_dtype is not None:
        dtypes.add(tf.as_dtype(cache_dtype))
    if len(dtypes) > 1:
        raise TypeError(f"the caches hold different dtypes: {sorted(d.name for d in dtypes)}")
    dtype = dtypes.pop() if dtypes else q_dtype
    if dtype != q_dtype and not (q_dtype == tf.float32 and dtype in CACHE_DTYPES):
        raise TypeError(f"the cache holds {dtype.name} but q is {q_dtype.name} (a cache must "
                        f"hold q's dtype, or 16 bits under a float32 q)")
    return dtype


def _handle(cache):
    """The resource handle of a cache given as a variable or a handle."""
    if isinstance(cache, tf.Variable):
        return cache.handle
    return tf.convert_to_tensor(cache, tf.resource)


def _call(op, q, key_cache, value_cache, rows, lengths, scale, isa="auto",
          kv_heads_per_item=0, cache_dtype=None, softcap=0.0):
    q = tf.convert_to_tensor(q)
    return op.tokenserve_paged_decode_attention(
        q, _handle(key_cache), _handle(value_cache), tf.cast(rows, tf.int32),
        tf.cast(lengths, tf.int32), scale=float(scale), softcap=float(softcap),
        Tcache=_cache_dtype(key_cache, value_cache, q.dtype, cache_dtype), isa=isa,
        kv_heads_per_item=kv_heads_per_item)


def _gather(cache, rows, cache_dtype: tf.DType, dtype: tf.DType):
    """cache rows [S, L] -> [S, L, width] in `dtype` (ResourceGather: no dense read of the
    cache; a 16-bit cache is widened after the gather, on the gathered rows only)."""
    if isinstance(cache, tf.Variable):
        gathered = tf.gather(cache, rows)
    else:
        gathered = tf.raw_ops.ResourceGather(resource=cache, indices=rows, dtype=cache_dtype)
    return tf.cast(gathered, dtype)


def paged_decode_attention_fallback(q, key_cache, value_cache, rows, lengths,
                                    scale: float, cache_dtype=None,
                                    softcap: float = 0.0) -> tf.Tensor:
    """Pure-TF paged_decode_attention, the engine's graph path (TransformerStep's decode
    attention): gather the rows ([S, L, Hkv*Dh] copies), spread each head's query over the
    kv-head columns (zero outside its own) so both batched matmuls read the rows in their
    stored layout, scores [S, H, L] in q's dtype, softmax in float32 over the valid positions."""
    q = tf.convert_to_tensor(q)
    rows = tf.cast(rows, tf.int32)
    lengths = tf.cast(lengths, tf.int32)
    stored = _cache_dtype(key_cache, value_cache, q.dtype, cache_dtype)
    keys = _gather(key_cache, rows, stored, q.dtype)                      # [S, L, W]
    values = _gather(value_cache, rows, stored, q.dtype)
    shape = tf.shape(q)
    num_seqs, num_heads, head_dim = shape[0], shape[1], shape[2]
    width = tf.shape(keys)[2]
    num_kv = width // head_dim
    checks = [
        tf.debugging.assert_equal(tf.rank(q), 3, message="q must be [S, H, Dh]"),
        tf.debugging.assert_equal(tf.rank(lengths), 1, message="lengths must be [S]"),
        tf.debugging.assert_equal(tf.shape(rows)[0], num_seqs,
                                  message="rows must be [S, L] for q's S"),
        tf.debugging.assert_equal(tf.shape(lengths)[0], num_seqs,
                                  message="lengths must be [S] for q's S"),
        tf.debugging.assert_equal(width % head_dim, 0,
                                  message="cache rows must hold Hkv * Dh values"),
        tf.debugging.assert_greater(num_kv, 0, message="cache rows must hold Hkv * Dh values"),
        tf.debugging.assert_equal(num_heads % tf.maximum(num_kv, 1), 0,
                                  message="H must be a multiple of the cache's Hkv"),
        tf.debugging.assert_less_equal(lengths, tf.shape(rows)[1],
                                       message="lengths must lie in [0, L]"),
        tf.debugging.assert_non_negative(lengths, message="lengths must lie in [0, L]"),
    ]
    with tf.control_dependencies(checks):
        group = num_heads // num_kv
    head_to_kv = tf.one_hot(tf.range(num_heads) // group, num_kv, dtype=q.dtype)  # [H, Hkv]
    scaled_head_to_kv = head_to_kv * tf.cast(scale, q.dtype)
    q_rows = tf.reshape(q[:, :, None, :] * scaled_head_to_kv[None, :, :, None],
                        [num_seqs, num_heads, width])
    scores = tf.cast(tf.matmul(q_rows, keys, transpose_b=True), tf.float32)  # [S, H, L]
    if softcap:
        scores = softcap * tf.tanh(scores / softcap)
    valid = tf.range(tf.shape(rows)[1])[None, :] < lengths[:, None]       # [S, L]
    probs = tf.nn.softmax(tf.where(valid[:, None, :], scores, tf.float32.min))
    probs *= tf.cast(lengths > 0, tf.float32)[:, None, None]               # empty: zeros
    out = tf.matmul(tf.cast(probs, values.dtype), values)                  # [S, H, W]
    out = tf.reshape(out, [num_seqs, num_heads, num_kv, head_dim])
    out = tf.reduce_sum(out * head_to_kv[None, :, :, None], axis=2)       # own kv head only
    return tf.reshape(out, [num_seqs, num_heads * head_dim])


def kernel_status() -> str:
    """One line: which path paged_decode_attention takes here, and why (builds the op if
    needed)."""
    return LIBRARY.status()


def is_compiled() -> bool:
    """True when paged_decode_attention runs the compiled op here (builds it if needed)."""
    return LIBRARY.is_compiled()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
