#!/usr/bin/env python
"""What the GGUF-block matmul op costs at SmolLM2-135M's shapes, against int8 and float32.

For each weight of SmolLM2 (inputs x outputs: 576x576 attention Q and output, 576x1536 MLP
gate and up, 1536x576 MLP down, 576x49152 the tied LM head) and M = 1 (one decode stream)
and 32 (32 streams, or a prefill chunk), the median time of one matmul by:
  f32    tf.matmul, float32 weights, graph-mode tf.function (oneDNN)
  int8   tokenserve's int8 op (one scale per output row, int8 activations per 32-block)
  q4_0, q4_1, q8_0
         the GGUF-block op on the same weights quantized by the gguf package; SmolLM2's file
         holds its block matrices as Q4_1 and its head as Q8_0
  q4_k, q5_k, q6_k
         the same op on K-quant super-blocks (random bytes with trained-size scales: gguf
         cannot quantize to them), only where K is a multiple of 256 (SmolLM2's 576 is not;
         1536x576 and --shapes 2048x2048, a Llama-3.2-1B-like square, are)
plus the weight bytes each reads per second, the file's type against f32 and int8, and each
K-quant against int8 (--methods measures only some: int8 is always among them).

Like a decode step, each matmul reads its weights from memory, not from cache: one timed call
runs the matmul over enough copies of the weights (at least 48 MB of each method's own bytes,
more than a 32 MB L3) and each product feeds the next one's input. The methods take turns
within every round (the order rotates), so a slow minute of a shared machine falls on each.

Output: a table and benchmarks/results/gguf_matmul.json (medians, machine flags, op builds).

Run:  python benchmarks/gguf_matmul.py [--reps 7] [--batches 1 32] [--shapes 576x576 ...]
          [--methods int8 q4_1 q4_k ...] [--output results/....json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from common import (RESULTS, machine_summary, make_console, make_table, rotated,  # noqa: E402
                    size_pair, write_result)

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (K inputs, N outputs)
BATCHES = [1, 32]
WORKING_SET = 48e6  # bytes of each method's weights cycled through per call: more than L3
METHODS = ["f32", "int8", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"]
GGUF_TYPES = ("q4_0", "q4_1", "q8_0")
K_QUANTS = {"q4_k": (144, [0, 2]), "q5_k": (176, [0, 2]), "q6_k": (210, [208])}


def kquant_blocks(n: int, k: int, name: str, rng):
    """uint8 [N, K / 256 * bytes]: random super-blocks, fp16 scales of trained weights' size."""
    import numpy as np

    size, offsets = K_QUANTS[name]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for offset in offsets:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return blocks.reshape(n, -1)


def file_type(k: int, n: int) -> str:
    """The block type SmolLM2-135M-Instruct.Q4_1.gguf stores this weight in."""
    return "q8_0" if n == 49152 else "q4_1"


def weights(k: int, n: int, seed: int = 0) -> dict:
    """Each method's weights for one shape, with their bytes: {method: (arrays, bytes)}."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from tokenserve.kernels import int8_matmul as im

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)  # [N, K], as GGUF stores it
    q, scale = im.quantize_weight(w.T)
    out = {"f32": ((np.ascontiguousarray(w.T),), w.nbytes), "int8": ((q, scale), q.nbytes)}
    for name in GGUF_TYPES:
        blocks = gguf_quants.quantize(w, GGMLQuantizationType[name.upper()])
        out[name] = ((blocks,), blocks.nbytes)
    if k % 256 == 0:
        for name in K_QUANTS:
            blocks = kquant_blocks(n, k, name, rng)
            out[name] = ((blocks,), blocks.nbytes)
    return out


def product(method: str):
    """(x, *weights) -> x @ W for one method."""
    import tensorflow as tf

    from tokenserve.kernels import gguf_matmul as gm
    from tokenserve.kernels import int8_matmul as im

    if method == "f32":
        return lambda x, w: tf.matmul(x, w)
    if method == "int8":
        return lambda x, q, scale: im.int8_matmul(x, q, scale)
    return lambda x, blocks: gm.gguf_matmul(x, blocks, method)


def measure(shapes, batches, reps: int, only=METHODS) -> list[dict]:
    """One row per (shape, batch): median ms per matmul of each method (the K-quants only
    where K is a multiple of 256)."""
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # one tf.function per method and shape is the point
    rng = np.random.default_rng(1)
    rows = []
    for k, n in shapes:
        per_method = {method: value for method, value in weights(k, n).items()
                      if method in only}
        copies, tensors = {}, {}
        for method, (arrays, nbytes) in per_method.items():
            copies[method] = max(1, int(np.ceil(WORKING_SET / nbytes)))
            # distinct tensors with the same values: only the bytes read matter here
            tensors[method] = [[tf.constant(a) for a in arrays] for _ in range(copies[method])]
        methods = [method for method in METHODS if method in per_method]
        for m in batches:
            x0 = tf.constant(rng.standard_normal((m, k)).astype(np.float32))
            steps = {}
            for method in methods:
                def chain(x, fn=product(method), ws=tensors[method]):
                    for w in ws:
                        y = fn(x, *w)
                        x = x + y[:, :1] * 1e-30  # the next matmul depends on this one
                    return x

                steps[method] = tf.function(chain)
                steps[method](x0)
                steps[method](x0).numpy()  # warm up: trace, fault the weights in
            times = {method: [] for method in methods}
            for r in range(reps):
                for method in rotated(methods, r):
                    start = time.perf_counter()
                    steps[method](x0).numpy()
                    times[method].append((time.perf_counter() - start) / copies[method])
            ms = {method: float(np.median(t)) * 1e3 for method, t in times.items()}
            row = {"k": k, "n": n, "m": m, "file_type": file_type(k, n), "ms": ms,
                   "copies": copies,
                   "weight_bytes": {method: nbytes for method, (_, nbytes) in per_method.items()},
                   "gb_s": {method: per_method[method][1] / (ms[method] * 1e-3) / 1e9
                            for method in methods}}
            rows.append(row)
            print(f"  {k}x{n} M={m}: " + ", ".join(f"{name} {v:.3f}" for name, v in ms.items()),
                  file=sys.stderr)
    return rows


def table(rows: list[dict]):
    methods = [m for m in METHODS if any(m in row["ms"] for row in rows)]
    kquants = [m for m in K_QUANTS if m in methods]
    out = make_table("median ms per matmul (weights from memory); the file's type against "
                     "f32 and int8, the K-quants against int8",
                     ["K x N", "M", *methods, "file's type", "its GB/s", "vs f32", "vs int8",
                      *[f"{m} vs int8" for m in kquants]])
    for row in rows:
        ms, own = row["ms"], row["file_type"]

        def ratio(base, method):
            return f"{ms[base] / ms[method]:.2f}x" if base in ms and method in ms else "-"

        out.add_row(f"{row['k']}x{row['n']}", str(row["m"]),
                    *[f"{ms[m]:.3f}" if m in ms else "-" for m in methods],
                    own, f"{row['gb_s'][own]:.1f}" if own in ms else "-", ratio("f32", own),
                    ratio("int8", own), *[ratio("int8", m) for m in kquants])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", type=size_pair, default=SHAPES)
    parser.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--output", type=Path, default=RESULTS / "gguf_matmul.json")
    args = parser.parse_args(argv)
    methods = list(dict.fromkeys(["int8", *args.methods]))  # the baseline of every ratio

    from tokenserve.kernels import gguf_matmul as gm
    from tokenserve.kernels import int8_matmul as im

    kernels = {"gguf_matmul": gm.kernel_status(), "int8_matmul": im.kernel_status()}
    for name, status in kernels.items():
        if not status.startswith("compiled"):
            raise SystemExit(f"{name}: the compiled op is needed for this benchmark: {status}")
    load_before = list(os.getloadavg())
    rows = measure(args.shapes, args.batches, args.reps, methods)
    info = write_result(args.output, kernels=kernels, reps=args.reps,
                        working_set_bytes=WORKING_SET, loadavg_before=load_before,
                        loadavg_after=list(os.getloadavg()), rows=rows)
    console = make_console(150)
    console.print(f"{machine_summary(info)}; load average {load_before[0]:.1f} -> "
                  f"{os.getloadavg()[0]:.1f}", markup=False)
    for name, status in kernels.items():
        console.print(f"{name}: {status}", markup=False)
    console.print(table(rows))
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
