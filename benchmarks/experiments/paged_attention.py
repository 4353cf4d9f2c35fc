#!/usr/bin/env python
"""What the fused paged decode-attention op buys over the engine's graph path, GPT-2-small sizes.

Median wall time of 12 layers' worth of decode attention (H = Hkv = 12, Dh = 64; each layer
has its own key and value cache variables of R = 32 * 1024 rows x 768, put in copy-on-read
mode by a scatter_update as in the engine) for S sequences x L context positions in
{1x160, 8x160, 32x160, 32x512, 32x1024}, float32 and bfloat16:
  op     TokenservePagedDecodeAttention, reading the rows in place from the variables
  graph  the engine's current path (TransformerStep._decode_attention as of d8b9600):
         ResourceGather of the rows into [S, L, 768] copies, each head's query spread over
         the kv-head columns, two batched matmuls (scores [S, H, L]), masked float32 softmax,
         and the per-head reduction of the [S, H, 768] output
Both run in one graph-mode tf.function with None-dim input signatures (as the engine's step);
each layer's queries depend on the previous layer's output (a tiny elementwise op, in both),
so the layers run one after another as in a model. Context rows are paged like the engine's:
blocks of 16 consecutive rows, the blocks at random places in the cache. Also reported: the
op's throughput in GB/s of key and value bytes read, and CPU time (all threads), which is
steadier than wall time on a shared machine, and the largest difference between the two
paths' outputs for one layer (relative to the largest output magnitude).

Two configurations, each in its own process (the ISA caps must be set before TF loads):
  default  no ISA caps; the op built with -march=native
  avx2     ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's matmuls limited to AVX2, no AVX-512 / bf16
           instructions), the op built with -mavx2 -mfma (TOKENSERVE_KERNELS_MARCH=avx2);
           float32 only: capped below bf16, oneDNN cannot create bf16 matmuls at all (TF 2.21
           segfaults in eager mode and aborts with dnnl::error in graph mode), which is why
           the engine never picks bf16 under such a cap (model/precision.cpu_has_bf16)

Output: a table per configuration and benchmarks/results/paged_attention.json.

Run from the repository's root:
      python -m benchmarks.experiments.paged_attention [--reps 9] [--configs default avx2]
          [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

from benchmarks.common import (RESULTS, add_config_arguments, machine_info, make_table,
                               measure_configs, run_child, size_pair, write_json)

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 12, 12, 12, 64
CACHE_ROWS, BLOCK = 32 * 1024, 16
SHAPES = [(1, 160), (8, 160), (32, 160), (32, 512), (32, 1024)]
DTYPES = ["float32", "bfloat16"]
CONFIGS = {
    "default": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "TOKENSERVE_KERNELS_MARCH": "avx2"},
}
CONFIG_DTYPES = {"default": DTYPES, "avx2": ["float32"]}  # see the docstring
METHODS = ["op", "graph"]


def paged_rows(rng, s: int, length: int):
    """[S, L] cache rows: each sequence's positions fill whole blocks of 16 rows, blocks at
    random distinct places in the cache (the engine's block tables)."""
    import numpy as np

    blocks_per_seq = -(-length // BLOCK)
    blocks = rng.permutation(CACHE_ROWS // BLOCK)[:s * blocks_per_seq].reshape(s, -1)
    rows = (blocks[:, :, None] * BLOCK + np.arange(BLOCK)).reshape(s, -1)[:, :length]
    return rows.astype(np.int32)


def measure(shapes, dtypes, reps: int) -> list[dict]:
    """Runs in the configured process: one row per (dtype, shape)."""
    import math

    import numpy as np
    import tensorflow as tf

    from tokenserve.kernels import paged_attention as pa

    width = KV_HEADS * HEAD_DIM
    scale = 1.0 / math.sqrt(HEAD_DIM)
    rng = np.random.default_rng(0)
    out_rows = []
    for dtype_name in dtypes:
        dtype = tf.as_dtype(dtype_name)
        caches = []
        for _ in range(LAYERS):
            pair = []
            for _ in range(2):
                var = tf.Variable(tf.cast(tf.random.normal([CACHE_ROWS, width]), dtype),
                                  trainable=False)
                # the engine's caches only ever see sparse writes: copy-on-read mode
                var.scatter_update(tf.IndexedSlices(tf.ones([1, width], dtype), [0]))
                pair.append(var)
            caches.append(tuple(pair))
        head_to_kv = tf.one_hot(tf.range(HEADS) // (HEADS // KV_HEADS), KV_HEADS, dtype=dtype)
        scaled_head_to_kv = head_to_kv * scale

        def graph_attention(q, rows, bias, cache):
            """TransformerStep._decode_attention, verbatim apart from the config lookups."""
            keys, values = tf.gather(cache[0], rows), tf.gather(cache[1], rows)
            num_seqs = tf.shape(q)[0]
            q_rows = tf.reshape(q[:, :, None, :] * scaled_head_to_kv[None, :, :, None],
                                [num_seqs, HEADS, width])
            scores = tf.matmul(q_rows, keys, transpose_b=True)            # [S, H, L]
            probs = tf.nn.softmax(tf.cast(scores, tf.float32) + bias)
            out = tf.matmul(tf.cast(probs, values.dtype), values)          # [S, H, W]
            if KV_HEADS > 1:
                out = tf.reshape(out, [num_seqs, HEADS, KV_HEADS, HEAD_DIM])
                out = tf.reduce_sum(out * head_to_kv[None, :, :, None], axis=2)
            return tf.reshape(out, [num_seqs, HEADS * HEAD_DIM])

        def layer(method, q, rows, lengths, bias, cache):
            if method == "op":
                return pa.compiled_paged_decode_attention(q, cache[0], cache[1], rows, lengths,
                                                          scale)
            return graph_attention(q, rows, bias, cache)

        def mask(rows, lengths):  # [S, 1, L]; the step builds it once for all layers
            return tf.where(tf.range(tf.shape(rows)[1])[None, None, :] < lengths[:, None, None],
                            0.0, tf.float32.min)

        def chain(q, rows, lengths, method):
            bias = mask(rows, lengths) if method == "graph" else None
            for cache in caches:
                out = layer(method, q, rows, lengths, bias, cache)
                q = q + tf.reshape(out, tf.shape(q)) * tf.constant(1e-30, dtype)
            return q

        signature = [tf.TensorSpec([None, None, None], dtype),
                     tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32)]
        steps = {method: tf.function(lambda q, r, n, m=method: chain(q, r, n, m),
                                     input_signature=signature) for method in METHODS}
        for s, length in shapes:
            q = tf.cast(tf.random.normal([s, HEADS, HEAD_DIM]), dtype)
            rows = tf.constant(paged_rows(rng, s, length))
            lengths = tf.fill([s], length)
            row = {"dtype": dtype_name, "s": s, "l": length, "ms": {}, "cpu_ms": {}}
            # one layer's outputs of both paths, for the difference between them
            outputs = {method: tf.cast(layer(method, q, rows, lengths, mask(rows, lengths),
                                             caches[0]), tf.float32) for method in METHODS}
            for step in steps.values():
                step(q, rows, lengths)  # warm up: trace, fault in
                step(q, rows, lengths)
            times = {method: [] for method in METHODS}
            cpu_times = {method: [] for method in METHODS}
            for _ in range(reps):  # interleaved, so both see the same load on a shared machine
                for method, step in steps.items():
                    start, cpu_start = time.perf_counter(), time.process_time()
                    step(q, rows, lengths).numpy()
                    times[method].append(time.perf_counter() - start)
                    cpu_times[method].append(time.process_time() - cpu_start)
            for method in METHODS:
                row["ms"][method] = float(np.median(times[method])) * 1e3
                row["cpu_ms"][method] = float(np.median(cpu_times[method])) * 1e3
            # relative to the output's largest magnitude
            row["max_rel_diff"] = float(tf.reduce_max(tf.abs(outputs["op"] - outputs["graph"]))
                                        / tf.reduce_max(tf.abs(outputs["graph"])))
            kv_bytes = 2 * LAYERS * s * length * width * dtype.size
            row["op_gb_s"] = kv_bytes / (row["ms"]["op"] * 1e-3) / 1e9
            row["speedup"] = row["ms"]["graph"] / row["ms"]["op"]
            row["speedup_cpu"] = row["cpu_ms"]["graph"] / row["cpu_ms"]["op"]
            out_rows.append(row)
            print(f"  {dtype_name} {s}x{length}: op {row['ms']['op']:.2f} ms, graph "
                  f"{row['ms']['graph']:.2f} ms", file=sys.stderr)
        del caches, steps
        gc.collect()
    return out_rows


def run_config(name: str, reps: int, shapes, dtypes) -> dict:
    """Measures one configuration in a child process with its environment."""
    dtypes = [dtype for dtype in dtypes if dtype in CONFIG_DTYPES[name]]
    return run_child(["--child", name, "--reps", str(reps),
                      "--shapes", *[f"{s}x{n}" for s, n in shapes], "--dtypes", *dtypes],
                     CONFIGS[name])


def child(name: str, reps: int, shapes, dtypes, output: Path) -> None:
    from tokenserve.kernels import paged_attention as pa

    status = pa.kernel_status()  # builds the op for this configuration's target
    print(f"[{name}] {status}", file=sys.stderr)
    if not status.startswith("compiled"):
        raise SystemExit(f"the compiled op is needed for this benchmark: {status}")
    result = {"kernel_status": status, "machine": machine_info(),
              "env": {var: os.environ.get(var) for var in
                      ("ONEDNN_MAX_CPU_ISA", "TOKENSERVE_KERNELS_MARCH")},
              "loadavg_before": list(os.getloadavg()),
              "rows": measure(shapes, dtypes, reps),
              "loadavg_after": list(os.getloadavg())}
    write_json(output, result)


def table(name: str, result: dict):
    env = ", ".join(f"{k}={v}" for k, v in result["env"].items() if v) or "no ISA caps"
    out = make_table(f"{name}: {env} — median ms for {LAYERS} layers of decode attention "
                     f"(H={HEADS}, Dh={HEAD_DIM}, cache {CACHE_ROWS} rows)",
                     ["dtype", "S x L", "op ms", "graph ms", "speedup", "speedup (cpu time)",
                      "op GB/s", "op vs graph"])
    for row in result["rows"]:
        out.add_row(row["dtype"], f"{row['s']}x{row['l']}", f"{row['ms']['op']:.2f}",
                    f"{row['ms']['graph']:.2f}", f"{row['speedup']:.2f}x",
                    f"{row['speedup_cpu']:.2f}x", f"{row['op_gb_s']:.1f}",
                    f"{row['max_rel_diff']:.1e}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    add_config_arguments(parser, CONFIGS)
    parser.add_argument("--shapes", nargs="+", type=size_pair, default=SHAPES)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=DTYPES)
    parser.add_argument("--quick", action="store_true", help="1x160 and 32x160, 3 reps")
    parser.add_argument("--output", type=Path, default=RESULTS / "paged_attention.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.quick:
        args.reps, args.shapes = 3, [(1, 160), (32, 160)]
    if args.child:
        child(args.child, args.reps, args.shapes, args.dtypes, args.child_output)
        return 0

    report = {"methods": {
        "op": "compiled TokenservePagedDecodeAttention (rows read in place from the variables)",
        "graph": "TransformerStep._decode_attention (d8b9600): ResourceGather copies + "
                 "queries spread over kv-head columns, batched matmuls, masked float32 "
                 "softmax"},
        "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "cache_rows": CACHE_ROWS, "block_size": BLOCK, "reps": args.reps, "configs": {}}
    measure_configs(args.configs, lambda name: run_config(name, args.reps, args.shapes,
                                                          args.dtypes),
                    table, report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
