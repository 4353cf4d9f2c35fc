#!/usr/bin/env python
"""How many vocabulary entries the LM head's screen would leave to recompute, for copies
of the head in other formats than the engine's: int8 with one scale per row (the default),
float16, and int4 with one scale per group of 32, 64 or 128 weights or per row.

The screen (engine/step/head.py) bounds each entry's error by Cauchy-Schwarz,
|w_i.x - h_i.x| <= ||w_i - h_i|| ||x||, and every entry whose upper bound reaches the best
lower bound is recomputed from the float32 head. This greedy-decodes a few prompts through
an in-process engine, keeps the hidden rows its screened head saw (the final norm's
output), and counts, in float64, the candidates each copy would leave on those rows. Not
timed: a count of candidates is what decides whether a smaller copy can pay (each
candidate is one float32 row read again, a copy of fewer bytes saves a fixed read).

Output: a table and benchmarks/results/screen-bounds[-NAME].json with the machine's flags.

Run from the repository's root:
      python -m benchmarks.experiments.screen_bounds EXPORT_DIR [--tokens 40] [--name NAME]
      (EXPORT_DIR: an exported float32 model, e.g. `tokenserve export gpt2-small
      --output /tmp/gpt2 --no-xla`)
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import (make_console, make_table, machine_info, machine_summary,
                               result_path, write_json)

PROMPTS = ["def read_config(path):", "The quick brown fox", "import numpy as np\n",
           "Once upon a time"]
# (name, bits, weights per scale; 0: one scale per row); float16 has no scale
FORMATS = [("int8, scale per row", 8, 0), ("float16", 16, None),
           ("int4, scale per 32", 4, 32), ("int4, scale per 64", 4, 64),
           ("int4, scale per 128", 4, 128), ("int4, scale per row", 4, 0)]


def copy_of(weight, bits: int, group: int | None):
    """The head as a copy in that format holds it, float64 [V, D]."""
    import numpy as np

    if bits == 16:
        return weight.astype(np.float16).astype(np.float64)
    vocab, width = weight.shape
    group = group or width
    top = 2 ** (bits - 1) - 1  # 127 or 7, symmetric as the engine's int8 copy
    grouped = weight.reshape(vocab, width // group, group)
    scale = np.abs(grouped).max(axis=2, keepdims=True) / top
    scale[scale == 0] = 1.0
    return (np.clip(np.rint(grouped / scale), -top, top) * scale).reshape(vocab, width)


def candidates(weight, rows, copy):
    """Per row of x: the entries whose upper bound reaches the best lower bound."""
    import numpy as np

    radius = np.linalg.norm(weight - copy, axis=1)[None, :] * np.linalg.norm(rows, axis=1)[:, None]
    approx = rows @ copy.T
    floor = (approx - radius).max(axis=1, keepdims=True)
    return ((approx + radius) >= floor).sum(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an exported float32 model (base or version directory)")
    parser.add_argument("--tokens", type=int, default=40, help="greedy tokens per prompt")
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import numpy as np
    import tensorflow as tf

    from tokenserve import LLM, SamplingParams
    from tokenserve.engine.step import head as screened_head
    from tokenserve.engine.config import EngineConfig

    seen: list = []
    original = screened_head.ScreenedHead.__call__

    def keeping(self, x, *rest, **options):  # traced once: the numpy_function runs per step
        kept = tf.numpy_function(lambda v: (seen.append(v.copy()), np.int32(0))[1], [x],
                                 tf.int32)
        with tf.control_dependencies([kept]):
            return original(self, tf.identity(x), *rest, **options)

    screened_head.ScreenedHead.__call__ = keeping
    try:
        llm = LLM(args.model, EngineConfig(precision="float32", max_num_seqs=len(PROMPTS),
                                           enable_prefix_caching=False))
        llm.generate(PROMPTS, SamplingParams(max_tokens=args.tokens, ignore_eos=True),
                     use_tqdm=False)
    finally:
        screened_head.ScreenedHead.__call__ = original
    head = llm.engine.runner.step.screened_head
    if head is None or not seen:
        raise SystemExit("this model's engine runs no screened head (a float32 transformer "
                         "export with a separate LM head is needed)")
    rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in seen]).astype(np.float64)
    weight = head.weight.numpy().astype(np.float64)
    weight = weight if head.layout == "nk" else weight.T
    table = make_table(f"screen candidates per row, {len(rows)} hidden rows, "
                       f"head {weight.shape[0]} x {weight.shape[1]}",
                       ("copy", "bytes per weight", "median", "mean", "p90", "max"),
                       left=("copy",))
    results = []
    for name, bits, group in FORMATS:
        counts = candidates(weight, rows, copy_of(weight, bits, group))
        scale_bytes = 0 if group is None else 4 / (group or weight.shape[1])
        entry = {"copy": name, "bytes_per_weight": bits / 8 + scale_bytes,
                 "median": float(np.median(counts)), "mean": float(counts.mean()),
                 "p90": float(np.percentile(counts, 90)), "max": int(counts.max())}
        results.append(entry)
        table.add_row(name, f"{entry['bytes_per_weight']:.3f}", f"{entry['median']:.0f}",
                      f"{entry['mean']:.1f}", f"{entry['p90']:.0f}", str(entry["max"]))
    console = make_console(80)
    info = machine_info()
    console.print(machine_summary(info))
    console.print(table)
    path = write_json(result_path("screen-bounds", args.name), {
        "machine": info, "model": str(args.model), "num_rows": len(rows),
        "vocab": weight.shape[0], "width": weight.shape[1], "formats": results})
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
