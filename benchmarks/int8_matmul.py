#!/usr/bin/env python
"""What the int8-weight matmul op buys on GPT-2-small decode shapes, against float32.

For each weight shape K x N (768x2304 attention QKV, 768x768 attention out, 768x3072 MLP up,
3072x768 MLP down, 768x50257 LM head) and batch M = 1, 8, 32, the median time of one matmul:
  f32         tf.matmul, float32 weights, graph-mode tf.function (oneDNN)
  f32 XLA     the same with jit_compile=True
  int8 op     tokenserve's compiled op (int8 activations per 32-block, the default; its
              AVX512-VNNI path where the CPU has one)
  int8 avx2   the same op held to its AVX2 path (isa="avx2"; the same as "int8 op" on a CPU
              without AVX512-VNNI)
  int8 op fa  the compiled op with float activations (exact, kept as an option)
  fallback    the pure-TF int8 path (cast + scale + tf.matmul), graph mode
plus the int8 op's weight bandwidth (GB/s of int8 weight bytes) and its speedup over f32 XLA.

Like a decode step, each matmul reads its weights from memory, not from cache: one timed
call runs the matmul over enough copies of the weights (>= 40 MB of int8, more than this
CPU's L3) and every product feeds the next one's input (so they run one after another, as
in a model; that adds a tiny [M, K] elementwise op per matmul to every column alike).

Two configurations, each in its own process (the ISA caps must be set before TF loads):
  default  no ISA caps; the op built with -march=native
  avx2     ONEDNN_MAX_CPU_ISA=AVX2 XLA_FLAGS=--xla_cpu_max_isa=AVX2, the op built with
           -mavx2 -mfma (TOKENSERVE_INT8_KERNEL_MARCH=avx2): what an AVX2-only CPU runs

Output: a table per configuration and benchmarks/results/int8_matmul.json.

Run:  python benchmarks/int8_matmul.py [--reps 7] [--configs default avx2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import (RESULTS, add_config_arguments, machine_info, make_table, measure_configs,
                    run_child, size_pair, write_json)
from read_bandwidth import read_bandwidth

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)]
BATCHES = [1, 8, 32]
WORKING_SET = 40e6  # int8 weight bytes cycled through per call: more than a 32 MB L3
CONFIGS = {
    "default": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
             "TOKENSERVE_INT8_KERNEL_MARCH": "avx2"},
}
METHODS = ["f32", "f32 XLA", "int8 op", "int8 avx2", "int8 op fa", "fallback"]


def measure(shapes, batches, reps: int) -> list[dict]:
    """Runs in the configured process: one row per (shape, batch)."""
    import numpy as np
    import tensorflow as tf

    from tokenserve.kernels import int8_matmul as im

    rng = np.random.default_rng(0)
    rows = []
    for k, n in shapes:
        copies = max(1, int(np.ceil(WORKING_SET / (k * n))))
        kernel = rng.standard_normal((k, n)).astype(np.float32) * 0.02
        q, scale = im.quantize_weight(kernel)
        # Distinct tensors with the same values: only the bytes read matter here.
        f32 = [tf.constant(kernel) for _ in range(copies)]
        int8 = [tf.constant(q) for _ in range(copies)]
        scale = tf.constant(scale)
        products = {
            "f32": lambda x, i: tf.matmul(x, f32[i]),
            "f32 XLA": lambda x, i: tf.matmul(x, f32[i]),
            "int8 op": lambda x, i: im.compiled_int8_matmul(x, int8[i], scale),
            "int8 avx2": lambda x, i: im.compiled_int8_matmul(x, int8[i], scale, isa="avx2"),
            "int8 op fa": lambda x, i: im.compiled_int8_matmul(x, int8[i], scale,
                                                               activations="float"),
            "fallback": lambda x, i: im.int8_matmul_fallback(x, int8[i], scale),
        }
        for m in batches:
            x0 = tf.constant(rng.standard_normal((m, k)).astype(np.float32))
            row = {"k": k, "n": n, "m": m, "copies": copies, "ms": {}, "cpu_ms": {}}
            for method, product in products.items():
                def chain(x, product=product):
                    for i in range(copies):
                        y = product(x, i)
                        x = x + y[:, :1] * 1e-30  # the next matmul depends on this one
                    return x

                step = tf.function(chain, jit_compile=method == "f32 XLA")
                step(x0)
                step(x0)  # warm up: trace, compile, fault in the weights
                times, cpu_times = [], []
                for _ in range(reps):
                    start, cpu_start = time.perf_counter(), time.process_time()
                    step(x0).numpy()
                    times.append((time.perf_counter() - start) / copies)
                    cpu_times.append((time.process_time() - cpu_start) / copies)
                row["ms"][method] = float(np.median(times)) * 1e3
                # CPU time of all threads: steadier than wall time on a shared machine.
                row["cpu_ms"][method] = float(np.median(cpu_times)) * 1e3
            row["int8_gb_s"] = k * n / (row["ms"]["int8 op"] * 1e-3) / 1e9
            row["speedup_vs_f32_xla"] = row["ms"]["f32 XLA"] / row["ms"]["int8 op"]
            row["speedup_vs_f32"] = row["ms"]["f32"] / row["ms"]["int8 op"]
            rows.append(row)
            print(f"  {k}x{n} M={m}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in
                                                   row["ms"].items()), file=sys.stderr)
    return rows


def run_config(name: str, reps: int, shapes, batches) -> dict:
    """Measures one configuration in a child process with its environment."""
    return run_child(["--child", name, "--reps", str(reps),
                      "--shapes", *[f"{k}x{n}" for k, n in shapes],
                      "--batches", *map(str, batches)], CONFIGS[name])


def child(name: str, reps: int, shapes, batches, output: Path) -> None:
    from tokenserve.kernels import int8_matmul as im

    status = im.kernel_status()  # builds the op for this configuration's target
    print(f"[{name}] {status}", file=sys.stderr)
    if not status.startswith("compiled"):
        raise SystemExit(f"the compiled op is needed for this benchmark: {status}")
    result = {"kernel_status": status, "machine": machine_info(),
              "env": {var: os.environ.get(var) for var in
                      ("ONEDNN_MAX_CPU_ISA", "XLA_FLAGS", "TOKENSERVE_INT8_KERNEL_MARCH")},
              "loadavg_before": list(os.getloadavg()),
              "rows": measure(shapes, batches, reps),
              "loadavg_after": list(os.getloadavg()),
              # a plain read of the same hour: at M = 1 the op can read no faster
              "read_bandwidth": read_bandwidth(reps=5)}
    write_json(output, result)


def table(name: str, result: dict):
    env = ", ".join(f"{k}={v}" for k, v in result["env"].items() if v) or "no ISA caps"
    read = result["read_bandwidth"]["all_threads_gb_s"]
    out = make_table(f"{name}: {env} — median ms per matmul (weights from DRAM); numpy sums "
                     f"read {read:.1f} GB/s on every core in this hour",
                     ["K x N", "M", *METHODS, "int8 GB/s", "of that read", "vs f32 XLA",
                      "vs f32", "vs f32 XLA, cpu time"])
    for row in result["rows"]:
        cpu = row["cpu_ms"]["f32 XLA"] / row["cpu_ms"]["int8 op"]
        out.add_row(f"{row['k']}x{row['n']}", str(row["m"]),
                    *[f"{row['ms'][method]:.3f}" for method in METHODS],
                    f"{row['int8_gb_s']:.1f}", f"{row['int8_gb_s'] / read:.0%}",
                    f"{row['speedup_vs_f32_xla']:.2f}x",
                    f"{row['speedup_vs_f32']:.2f}x", f"{cpu:.2f}x")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    add_config_arguments(parser, CONFIGS)
    parser.add_argument("--shapes", nargs="+", type=size_pair, default=SHAPES)
    parser.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    parser.add_argument("--quick", action="store_true", help="M = 1 and 32, 3 reps")
    parser.add_argument("--output", type=Path, default=RESULTS / "int8_matmul.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.quick:
        args.reps, args.batches = 3, [1, 32]
    if args.child:
        child(args.child, args.reps, args.shapes, args.batches, args.child_output)
        return 0

    report = {"methods": {
        "f32": "tf.matmul, float32 weights, graph-mode tf.function",
        "f32 XLA": "the same with jit_compile=True",
        "int8 op": "compiled TokenserveInt8Matmul, int8 activations per 32-block (default)",
        "int8 op fa": "compiled TokenserveInt8Matmul, float activations",
        "fallback": "pure-TF int8: cast + scale + tf.matmul, graph mode"},
        "reps": args.reps, "working_set_int8_bytes": WORKING_SET, "configs": {}}
    measure_configs(args.configs, lambda name: run_config(name, args.reps, args.shapes,
                                                          args.batches),
                    table, report, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
