#!/usr/bin/env python
"""What the engine's precision option costs and buys: bf16 (oneDNN/AMX) against fp32.

Quality: held-out perplexity of the shipped built-in models (Transformer and LSTM) computed
with the same weights in float32 and in bfloat16 (`--windows` windows of 256 tokens from the
stdlib files held out of training). The project's gate refuses an optimization that costs
more than 5% perplexity.

Speed: the engine's decode step on a GPT-2-small-shaped model (random weights), 32
sequences with 200 live positions, in both precisions (medians of `--steps` steps).

Output: a table (under a one-line CPU summary) and benchmarks/results/precision.json (with
the machine: CPU model, ISA flags, ISA-capping environment; bf16 speed depends on them).

Run:  python benchmarks/precision.py [--windows 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from common import (RESULTS, make_console, make_table, machine_info, machine_summary,
                    write_json)

console = make_console(120)
GATE = 0.05


def perplexities(source: str, windows: int) -> dict:
    from tokenserve.model import build_model
    from tokenserve.model.checkpoint import BUILTIN_DIR, load_source
    from tokenserve.model.tokenizer import Tokenizer
    from tokenserve.train.corpus import Corpus, token_stream
    from tokenserve.train.trainer import holdout_windows, perplexity

    model, _, config = load_source(source)
    corpus = Corpus.from_stdlib(holdout_fraction=0.05)
    stream = token_stream(corpus.holdout_texts, Tokenizer.load(BUILTIN_DIR / "tokenizer.json"))
    data = holdout_windows(stream, 256, windows)
    bf16 = build_model(config.model, dtype="bfloat16")
    for target, weight in zip(bf16.weights, model.weights):
        target.assign(weight.numpy().astype(target.dtype))
    fp32_ppl, bf16_ppl = perplexity(model, data), perplexity(bf16, data)
    return {"source": source, "windows": int(len(data)), "fp32": fp32_ppl, "bf16": bf16_ppl,
            "relative_change": bf16_ppl / fp32_ppl - 1.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", type=Path, default=RESULTS / "precision.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    from kv_capacity import measure

    from tokenserve.config import GenerationConfig, preset
    from tokenserve.model import build_model

    report = {"quality": [perplexities(s, args.windows) for s in ("builtin", "builtin-lstm")],
              "speed": {}, "machine": {**machine_info(), "loadavg": list(os.getloadavg())}}
    arch = preset("gpt2-small")
    config = GenerationConfig(model=arch, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    for precision in ("float32", "bfloat16"):
        model = build_model(arch, seed=0, dtype=precision)
        times = measure(model, config, precision, 256, 200, args.steps, dense=False)
        report["speed"][precision] = {"median_step_s": float(np.median(times)),
                                      "tok_s": 32 / float(np.median(times))}
    report["speed"]["speedup"] = (report["speed"]["float32"]["median_step_s"]
                                  / report["speed"]["bfloat16"]["median_step_s"])

    table = make_table("bf16 vs fp32: held-out perplexity of the built-in models",
                       ("model", "windows", "fp32 ppl", "bf16 ppl", "change",
                        f"within {GATE:.0%}"))
    for q in report["quality"]:
        table.add_row(q["source"], str(q["windows"]), f"{q['fp32']:.3f}", f"{q['bf16']:.3f}",
                      f"{q['relative_change']:+.2%}", str(abs(q["relative_change"]) <= GATE))
    console.print(machine_summary(report["machine"]), markup=False)
    console.print(table)
    speed = report["speed"]
    console.print(f"engine decode step, GPT-2-small, 32 seqs x 200 positions: fp32 "
                  f"{speed['float32']['median_step_s'] * 1000:.1f} ms, bf16 "
                  f"{speed['bfloat16']['median_step_s'] * 1000:.1f} ms "
                  f"({speed['speedup']:.2f}x)")
    write_json(args.output, report)
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
