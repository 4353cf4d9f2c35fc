#!/usr/bin/env python
"""Training-step time of the built-in architectures: mixed bf16 (oneDNN) vs float32 (+XLA).

Why `tokenserve train` defaults to bf16: this measures one optimizer step (batch 16 x 256
tokens) of each built-in architecture under both precisions, in the same run, and prints
medians and the speedup. Writes benchmarks/results/train_step.json.

    python benchmarks/train_step.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenserve.config import TrainConfig  # noqa: E402
from tokenserve.model import build_model  # noqa: E402
from tokenserve.train.builtin import builtin_architecture  # noqa: E402
from tokenserve.train.trainer import Trainer  # noqa: E402


def time_steps(family: str, precision: str, steps: int, tmp: Path) -> list[float]:
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if precision == "bf16" else "float32")
    model = build_model(builtin_architecture(family, 8192), seed=0)
    keras.mixed_precision.set_global_policy("float32")
    config = TrainConfig(precision=precision)
    trainer = Trainer(model, config, tmp / f"{family}-{precision}")
    batch = np.random.default_rng(0).integers(0, 8192, (config.batch_size, config.seq_len + 1))
    inputs, targets = batch[:, :-1].astype(np.int32), batch[:, 1:].astype(np.int32)
    float(trainer._train_step(inputs, targets))  # trace and compile
    samples = []
    for _ in tqdm(range(steps), desc=f"{family} {precision}", leave=False):
        start = time.perf_counter()
        float(trainer._train_step(inputs, targets))
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/train_step.json"))
    args = parser.parse_args()
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("transformer", "lstm"):
            for precision in ("fp32", "bf16"):
                results[f"{family}/{precision}"] = time_steps(family, precision, args.steps,
                                                              Path(tmp))
    table = Table(title="train step, batch 16 x 256 tokens (median seconds)")
    for column in ("model", "fp32 + XLA", "bf16 (oneDNN)", "bf16 speedup"):
        table.add_column(column, justify="right")
    summary = {}
    for family in ("transformer", "lstm"):
        fp32 = statistics.median(results[f"{family}/fp32"])
        bf16 = statistics.median(results[f"{family}/bf16"])
        summary[family] = {"fp32_xla_s": fp32, "bf16_s": bf16, "speedup": fp32 / bf16}
        table.add_row(family, f"{fp32:.3f}", f"{bf16:.3f}", f"{fp32 / bf16:.2f}x")
    Console().print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"steps": args.steps, "cpu_count": os.cpu_count(),
                                       "median": summary, "samples": results}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
