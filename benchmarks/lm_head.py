#!/usr/bin/env python
"""The LM head of an exported float32 model: XLA's program, the fused dense op and the int8
and float16 screens, by rows.

The engine's steps run the head on one row per sequence. Steps through XLA ran it as an XLA
program per row bucket; where no step can have more sequences than the fused ops take, they
run the fused op instead (TransformerStep.fused_head); greedy steps of a few rows run a
screen (int8 by default, or float16), which recomputes in float32 only the entries that
could be a row's argmax (engine/screened_head.py). This measures the four on the same final
norm + head (GPT-2-small's is tied: [50257, 768]), each a graph-mode tf.function called
with [rows, D] float32 inputs, alternating calls, medians of `--reps`; the largest
difference between the XLA and fused logits, whether each screen's argmax is the fused
head's, and how many entries per row it recomputed. The inputs are random hidden states (the engine's own counts its candidates on
real ones: benchmarks/screened_head.py).

Output: a table and benchmarks/results/lm-head[-NAME].json with the machine's flags.

Run:  python benchmarks/lm_head.py EXPORT_DIR [--rows 1 2 4 8 16 32] [--reps 15] [--name NAME]
      (EXPORT_DIR: e.g. `tokenserve export gpt2-small --output /tmp/gpt2 --no-xla`)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from machine import machine_info, machine_summary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an exported float32 model (base or version directory)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf
    from rich.console import Console
    from rich.table import Table

    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.runner import ModelRunner

    runner, _ = ModelRunner.from_model_dir(
        args.model, EngineConfig(precision="float32", max_num_seqs=max(args.rows),
                                 max_cache_tokens=1024))
    step = runner.step
    if not (step.jit_dense and step.kernel_dense):
        sys.exit("needs float32 weights with XLA dense layers and the fused dense op built")
    heads = {"xla": tf.function(step._head, autograph=False),
             "fused": tf.function(step._head_k, autograph=False)}
    screens = {}
    if step.screened_head is not None:
        from tokenserve.engine.screened_head import SCREEN_DTYPES, ScreenedHead

        first = step.screened_head
        screens = {dtype: first if first.dtype == dtype else
                   ScreenedHead(first.weight, first.layout, first.bias, dtype=dtype)
                   for dtype in SCREEN_DTYPES}
        for dtype, head in screens.items():
            heads[f"screened-{dtype}"] = tf.function(_with_screen(step, head), autograph=False)
    width = runner.model.config.hidden_size
    rng = np.random.default_rng(0)
    results = []
    for rows in args.rows:
        x = tf.constant(rng.standard_normal([rows, width], np.float32))
        logits = {name: fn(x).numpy() for name, fn in heads.items()}  # traced and compiled
        times = {name: [] for name in heads}
        for _ in range(args.reps):
            for name, fn in heads.items():
                started = time.perf_counter()
                fn(x).numpy()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        result = {"rows": rows, "xla_ms": medians["xla"], "fused_ms": medians["fused"],
                  "max_abs_diff": float(np.abs(logits["xla"] - logits["fused"]).max()),
                  "xla_samples_ms": [t * 1e3 for t in times["xla"]],
                  "fused_samples_ms": [t * 1e3 for t in times["fused"]]}
        for dtype, head in screens.items():
            name = f"screened-{dtype}"
            result[f"screened_{dtype}"] = {
                "ms": medians[name], "samples_ms": [t * 1e3 for t in times[name]],
                "same_argmax": bool((logits[name].argmax(-1)
                                     == logits["fused"].argmax(-1)).all()),
                "candidates": _candidates(step, head, x)}
        results.append(result)
        print(f"{rows} rows: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items()),
              flush=True)

    machine = machine_info()
    table = Table(title=f"LM head of {args.model}", caption=machine_summary(machine))
    columns = ["rows", "XLA ms", "fused ms", "XLA / fused", "max |diff|"]
    for dtype in screens:
        columns += [f"{dtype} screen ms", f"fused / {dtype}", "same argmax",
                    "candidates / row (median)"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        cells = [str(r["rows"]), f"{r['xla_ms']:.2f}", f"{r['fused_ms']:.2f}",
                 f"{r['xla_ms'] / r['fused_ms']:.2f}x", f"{r['max_abs_diff']:.1e}"]
        for dtype in screens:
            screen = r[f"screened_{dtype}"]
            cells += [f"{screen['ms']:.2f}", f"{r['fused_ms'] / screen['ms']:.2f}x",
                      "yes" if screen["same_argmax"] else "NO",
                      f"{statistics.median(screen['candidates']):.0f}"]
        table.add_row(*cells)
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"lm-head{'-' + args.name if args.name else ''}.json"
    path.write_text(json.dumps({"machine": machine, "model": str(args.model),
                                "reps": args.reps, "results": results}, indent=1))
    print(f"wrote {path}")


def _with_screen(step, head):
    """The step's screened head (final norm + screen) with `head` as its screen."""
    def screened(x):
        kept, step.screened_head = step.screened_head, head
        try:
            return step._head_screened(x)
        finally:
            step.screened_head = kept
    return screened


def _candidates(step, head, x) -> list[int]:
    """How many entries of each row `head` recomputes in float32."""
    import tensorflow as tf

    from tokenserve.model.layers import norm

    c = step.model.config
    normed = norm(x, step.model.final_norm.weights_dict(), c.norm, c.norm_eps)
    approx, bound = head.bounds(normed)
    floor = tf.reduce_max(approx - bound, axis=-1, keepdims=True)
    return [int(n) for n in tf.reduce_sum(tf.cast(approx + bound >= floor, tf.int32), -1)]


if __name__ == "__main__":
    main()
