#!/usr/bin/env python
"""The LM head of an exported float32 model: XLA's program against the fused dense op, by rows.

The engine's steps run the head on one row per sequence. Steps through XLA ran it as an XLA
program per row bucket; where no step can have more sequences than the fused ops take, they
run the fused op instead (TransformerStep.fused_head). This measures both on the same final
norm + head (GPT-2-small's is tied: [50257, 768]), each a graph-mode tf.function called with
[rows, D] float32 inputs, alternating calls, medians of `--reps`; and the largest difference
between their logits.

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
        results.append({"rows": rows, "xla_ms": medians["xla"], "fused_ms": medians["fused"],
                        "max_abs_diff": float(np.abs(logits["xla"] - logits["fused"]).max()),
                        "xla_samples_ms": [t * 1e3 for t in times["xla"]],
                        "fused_samples_ms": [t * 1e3 for t in times["fused"]]})
        print(f"{rows} rows: xla {medians['xla']:.2f} ms, fused {medians['fused']:.2f} ms",
              flush=True)

    machine = machine_info()
    table = Table(title=f"LM head of {args.model}", caption=machine_summary(machine))
    for column in ("rows", "XLA ms", "fused ms", "XLA / fused", "max |diff|"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["rows"]), f"{r['xla_ms']:.2f}", f"{r['fused_ms']:.2f}",
                      f"{r['xla_ms'] / r['fused_ms']:.2f}x", f"{r['max_abs_diff']:.1e}")
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"lm-head{'-' + args.name if args.name else ''}.json"
    path.write_text(json.dumps({"machine": machine, "model": str(args.model),
                                "reps": args.reps, "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
