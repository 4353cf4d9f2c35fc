#!/usr/bin/env python
"""Prefill attention over the paged KV cache: the fused decode op, one query per prompt token,
against the gathered graph path the engine ran before (GPT-2-small sizes, one layer).

  op      TokenservePagedDecodeAttention with each prefill token as a decode query: its
          sequence's cache rows [Np, L] (gathered once per step) and length = position + 1
  graph   TransformerStep's graph path (`_prefill_attention`, the fallback where the op
          cannot be built): ResourceGather of each chunk's rows into [S, L, 768] copies
          widened from the 16-bit cache to float32, the queries gathered into [S, T, H, Dh],
          masked attention (model.layers.attend), and the chunk outputs unpacked into tokens

Both read a float16 cache of 32k rows x 768 (the engine's default under float32 compute),
in copy-on-read mode after a scatter as in the engine, inside graph-mode tf.functions with
None-dim signatures. Shapes are (chunks S, tokens per chunk T, cached positions before the
chunk): a short prompt, a full 512-token step, a 512-token chunk after 1,000 cached tokens
(a continued chat turn), four 128-token prompts at once, and a 100-token turn after 1,500.
The two methods alternate, `--reps` times each; medians are reported with their ratio and
the largest difference between the outputs.

Output: a table and benchmarks/results/prefill-attention[-NAME].json with the machine's flags.

Run:  python benchmarks/prefill_attention.py [--reps 9] [--name NAME]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

from common import (make_console, make_table, machine_info, machine_summary, result_path,
                    write_json)

HEADS, HEAD_DIM, CACHE_ROWS, BLOCK = 12, 64, 32 * 1024, 16
SHAPES = [(1, 32, 0), (1, 128, 0), (1, 512, 0), (1, 512, 1000), (4, 128, 300), (1, 100, 1500)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import numpy as np
    import tensorflow as tf

    from tokenserve.kernels import paged_attention as pa
    from tokenserve.model.layers import attend

    if not pa.is_compiled():
        sys.exit(f"the paged attention op is unavailable: {pa.kernel_status()}")
    width = HEADS * HEAD_DIM
    caches = []
    for _ in range(2):
        variable = tf.Variable(tf.cast(tf.random.normal([CACHE_ROWS, width]), tf.float16),
                               trainable=False)
        variable.scatter_update(tf.IndexedSlices(tf.ones([1, width], tf.float16), [0]))
        caches.append(variable)
    keys_cache, values_cache = caches

    def graph(q, index, rows, pos, unpack):
        mask = tf.range(tf.shape(rows)[1])[None, None, :] <= pos[:, :, None]     # [S, T, L]
        keys, values = (tf.cast(tf.gather(v, rows), tf.float32) for v in caches)
        shape = tf.concat([tf.shape(rows), [HEADS, HEAD_DIM]], 0)
        q = tf.concat([q, tf.zeros_like(q[:1])], 0)  # index padding points at the zero row
        out = attend(tf.gather(q, index), tf.reshape(keys, shape), tf.reshape(values, shape),
                     mask)
        return tf.gather(tf.reshape(out, [-1, width]), unpack)

    def op(q, index, rows, pos, unpack):
        sequence = unpack // tf.shape(index)[1]
        lengths = tf.gather(tf.reshape(pos, [-1]), unpack) + 1
        return pa.paged_decode_attention(q, keys_cache, values_cache,
                                         tf.gather(rows, sequence), lengths,
                                         1.0 / math.sqrt(HEAD_DIM))

    spec = tf.TensorSpec
    signature = [spec([None, HEADS, HEAD_DIM], tf.float32), spec([None, None], tf.int32),
                 spec([None, None], tf.int32), spec([None, None], tf.int32),
                 spec([None], tf.int32)]
    methods = {name: tf.function(fn, input_signature=signature, autograph=False)
               for name, fn in (("op", op), ("graph", graph))}
    rng = np.random.default_rng(0)
    results = []
    for chunks, tokens, cached in SHAPES:
        length = cached + tokens
        blocks = rng.permutation(CACHE_ROWS // BLOCK)[:chunks * -(-length // BLOCK)]
        rows = (blocks.reshape(chunks, -1)[:, :, None] * BLOCK + np.arange(BLOCK))
        rows = rows.reshape(chunks, -1)[:, :length].astype(np.int32)
        index = np.arange(chunks * tokens, dtype=np.int32).reshape(chunks, tokens)
        pos = (cached + np.tile(np.arange(tokens, dtype=np.int32), (chunks, 1)))
        unpack = np.arange(chunks * tokens, dtype=np.int32)
        q = tf.random.normal([chunks * tokens, HEADS, HEAD_DIM])
        inputs = (q, index, rows, pos, unpack)
        outputs = {name: fn(*inputs).numpy() for name, fn in methods.items()}  # traced, warm
        times = {name: [] for name in methods}
        for _ in range(args.reps):
            for name, fn in methods.items():
                started = time.perf_counter()
                fn(*inputs).numpy()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results.append({"chunks": chunks, "tokens": tokens, "cached": cached,
                         "op_ms": medians["op"], "graph_ms": medians["graph"],
                         "speedup": medians["graph"] / medians["op"],
                         "max_abs_diff": float(np.abs(outputs["op"] - outputs["graph"]).max()),
                         "op_samples_ms": [t * 1e3 for t in times["op"]],
                         "graph_samples_ms": [t * 1e3 for t in times["graph"]]})
        print(f"{chunks} x {tokens} after {cached}: op {medians['op']:.2f} ms, "
              f"graph {medians['graph']:.2f} ms", flush=True)

    machine = machine_info()
    table = make_table("prefill attention, one layer (GPT-2-small: 12 heads x 64, float16 "
                       "cache)", ("chunks x tokens", "cached before", "op ms", "graph ms",
                                  "graph / op", "max |diff|"), caption=machine_summary(machine))
    for r in results:
        table.add_row(f"{r['chunks']} x {r['tokens']}", str(r["cached"]), f"{r['op_ms']:.2f}",
                      f"{r['graph_ms']:.2f}", f"{r['speedup']:.2f}x", f"{r['max_abs_diff']:.1e}")
    make_console(80).print(table)
    path = write_json(result_path("prefill-attention", args.name),
                      {"machine": machine, "reps": args.reps, "results": results}, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
