#!/usr/bin/env python
"""Predict latency of the TF Serving path: the old servable (`tf.saved_model.load`, a concrete
function per signature, called with `tf.constant` inputs) against the new one (the MetaGraph
in a TF1 Session, run by tensor name, as tensorflow_model_server does).

Models, both built here: TF Serving's half_plus_two (TF1 graph, rebuilt with tf.compat.v1 as
in tests/tfserving_models.py) and a mid-size Keras model (an MLP 512-2048-2048-2048-10, 9.5M
parameters, through `model.export`). Each is timed at batch 1 and 32 through the servable's
`run()` (what a Predict call does after decoding its request), old and new alternating in
rounds (the order flipping every round) so that load on the machine falls on both alike; the
table shows, per call, the median of the round medians, the best round's median (the least
disturbed by other work on a shared machine) and P90.

The old path is replicated here as it ran before the change (commit 7a429bf:
lifecycle/savedmodel.py): its checks, `tf.constant` per input, the signature function, and
`.numpy()` per output.

Output: a table (under a one-line CPU summary) and benchmarks/results/tfserving_predict.json.

Run:  python benchmarks/tfserving_predict.py [--calls 300] [--rounds 8] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from machine import machine_info, machine_summary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=120)


class OldServable:
    """The pre-Session servable: tf.saved_model.load and its signature functions."""

    def __init__(self, path: Path):
        import tensorflow as tf

        from tokenserve.lifecycle.session_bundle import read_saved_model

        self._tf = tf
        meta_graph = read_saved_model(path).meta_graphs[0]
        self.signature_defs = {name: sig for name, sig in meta_graph.signature_def.items()
                               if not name.startswith("__")}
        self._model = tf.saved_model.load(str(path))
        self._functions = dict(self._model.signatures)

    def run(self, signature_name: str, inputs: dict) -> dict:
        tf = self._tf
        sig = self.signature_defs[signature_name or "serving_default"]
        if set(inputs) != set(sig.inputs):
            raise ValueError("input size does not match signature")
        for key, value in inputs.items():  # the old rank/dimension check
            shape = sig.inputs[key].tensor_shape
            expected = [dim.size for dim in shape.dim]
            if not shape.unknown_rank and (len(expected) != value.ndim or any(
                    e >= 0 and e != g for e, g in zip(expected, value.shape))):
                raise ValueError(f"Shape of tensor {key} is not compatible")
        outputs = sorted(sig.outputs)
        tensors = {key: tf.constant(value, dtype=tf.dtypes.as_dtype(sig.inputs[key].dtype))
                   for key, value in inputs.items()}
        result = self._functions[signature_name or "serving_default"](**tensors)
        return {key: result[key].numpy() for key in outputs}


def keras_mlp(base: Path) -> Path:
    import keras

    inputs = keras.Input(shape=(512,), name="features")
    hidden = inputs
    for index in range(3):
        hidden = keras.layers.Dense(2048, activation="relu", name=f"hidden_{index}")(hidden)
    outputs = keras.layers.Dense(10, name="logits")(hidden)
    model = keras.Model(inputs, outputs)
    path = base / "1"
    model.export(str(path), verbose=False)
    return path, model.count_params()


def time_calls(servable, inputs: dict, calls: int) -> list[float]:
    for _ in range(20):
        servable.run("", inputs)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        servable.run("", inputs)
        times.append(time.perf_counter() - started)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output", type=Path, default=RESULTS / "tfserving_predict.json")
    args = parser.parse_args(argv)

    import tfserving_models

    from tokenserve.lifecycle.savedmodel import SavedModelServable

    work = Path(tempfile.mkdtemp(prefix="tfserving-predict-"))
    half = tfserving_models.write_half_plus_two(work / "half_plus_two", 1)
    mlp, params = keras_mlp(work / "keras_mlp")
    cases = []
    for model, path, key, make in (
            ("half_plus_two", half, "x",
             lambda n: np.arange(n, dtype=np.float32).reshape(n, 1)),
            (f"Keras MLP {params / 1e6:.1f}M", mlp, "features",
             lambda n: np.random.default_rng(0).standard_normal((n, 512), np.float32))):
        paths = {"old": OldServable(path), "new": SavedModelServable(path)}
        for batch in (1, 32):
            inputs = {key: make(batch)}
            np.testing.assert_allclose(*(next(iter(paths[name].run("", inputs).values()))
                                         for name in ("old", "new")), rtol=1e-5)
            rounds = {"old": [], "new": []}
            for index in range(args.rounds):
                for name in ("old", "new") if index % 2 == 0 else ("new", "old"):
                    rounds[name].append(time_calls(paths[name], inputs, args.calls))
            row = {"model": model, "batch": batch}
            for name, runs in rounds.items():
                every = [t for run in runs for t in run]
                medians = [statistics.median(run) for run in runs]
                row[f"{name}_median_us"] = statistics.median(medians) * 1e6
                row[f"{name}_best_round_us"] = min(medians) * 1e6
                row[f"{name}_p90_us"] = float(np.percentile(every, 90)) * 1e6
            row["speedup"] = row["old_median_us"] / row["new_median_us"]
            cases.append(row)

    info = machine_info()
    console.print(machine_summary(info))
    table = Table(title="Predict latency per call, µs: old (tf.saved_model.load) vs new "
                        "(Session)")
    for column in ("model", "batch", "old median", "new median", "old best", "new best",
                   "old P90", "new P90", "speedup"):
        table.add_column(column, justify="left" if column == "model" else "right",
                         no_wrap=True)
    for row in cases:
        table.add_row(row["model"], str(row["batch"]), *(
            f"{row[key]:.0f}" for key in ("old_median_us", "new_median_us", "old_best_round_us",
                                          "new_best_round_us", "old_p90_us", "new_p90_us")),
            f"{row['speedup']:.2f}x")
    console.print(table)
    out = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "calls_per_round": args.calls,
                               "rounds": args.rounds, "cases": cases}, indent=2) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
