#!/usr/bin/env python
"""Does a decode step cost grow with the KV cache's capacity, or only with live tokens?

Model: GPT-2-small-shaped Transformer (random weights) in the engine's runner. 32 sequences,
each with `--live` positions in the cache (default 200), take decode steps; the cache's
capacity goes from 256 to 4,096 positions per sequence (8,192 -> 131,072 rows in all).

Systems, in one run:
  paged        the engine's step: scatter the new rows, gather only the live rows.
  dense-read   the same step, except attention reads the cache variables densely
               (`tf.convert_to_tensor(var)` then gather), as code that treats the cache as a
               plain tensor would. After a scatter, TF keeps the variable in copy-on-read
               mode, so each dense read copies the whole cache (the trap docs/engine.md describes).

Target (docs/engine.md#facts-about-tensorflow-on-these-cpus-that-shaped-the-step):
paged step time at 4,096 / at 256 <= 1.2.
Output: a table (under a one-line CPU summary), benchmarks/results/kv_capacity.json (with
the machine: CPU model, ISA flags, ISA-capping environment) and kv_capacity.png.

Run:  python benchmarks/kv_capacity.py [--precision bfloat16] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, pyplot,
                    write_json)

console = make_console(120)


def make_dense_step_class():
    import tensorflow as tf

    from tokenserve.engine.step.attention import PagedAttention
    from tokenserve.engine.step.transformer import TransformerStep

    class DenseReadAttention(PagedAttention):
        def gather_kv(self, rows, cache):
            keys, values = cache
            return (tf.gather(tf.convert_to_tensor(keys), rows),
                    tf.gather(tf.convert_to_tensor(values), rows))

    class DenseReadStep(TransformerStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            a = self.attention
            self.attention = DenseReadAttention(a.config, a.kv_width, a.compute_dtype, a.fused)

    return DenseReadStep


def measure(model, config, precision: str, capacity_per_seq: int, live: int, steps: int,
            dense: bool, num_seqs: int = 32) -> list[float]:
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.request import Request
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.engine.scheduler import Scheduler
    from tokenserve.sampling import SamplingParams

    engine_config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * live,
                                 precision=precision,
                                 max_cache_tokens=num_seqs * capacity_per_seq)
    original = None
    if dense:
        import tokenserve.engine.step.transformer as tf_step
        original = tf_step.TransformerStep
        tf_step.TransformerStep = make_dense_step_class()
    try:
        runner = ModelRunner(model, config, engine_config)
    finally:
        if original is not None:
            tf_step.TransformerStep = original
    scheduler = Scheduler(engine_config, runner.cache)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        scheduler.add(Request(f"r{i}", rng.integers(3, 8000, size=live - 1).tolist(),
                              SamplingParams(max_tokens=steps + 2)))

    def advance(out):
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.token_ids.append(5)

    while True:  # prefill everything
        out = scheduler.schedule()
        runner.execute(out)
        advance(out)
        if all(s.num_pending_tokens == 1 for s in scheduler.running) and not scheduler.waiting:
            break
    times = []
    for _ in range(steps):
        out = scheduler.schedule()
        started = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - started)
        advance(out)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--live", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dense-steps", type=int, default=3)
    parser.add_argument("--capacities", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--output", type=Path, default=RESULTS / "kv_capacity.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    from tokenserve.config import GenerationConfig, preset
    from tokenserve.model.precision import resolve_precision
    from tokenserve.model import build_model

    precision = resolve_precision(args.precision)
    arch = preset("gpt2-small")
    config = GenerationConfig(model=arch, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = build_model(arch, seed=0, dtype=precision)
    results = {"workload": {"model": "gpt2-small (random)", "precision": precision,
                            "num_seqs": 32, "live_positions": args.live},
               "machine": {**machine_info(), "loadavg": list(os.getloadavg())},
               "runs": []}
    for system, dense in (("paged", False), ("dense-read", True)):
        for capacity in args.capacities:
            steps = args.dense_steps if dense else args.steps
            console.print(f"{system}: capacity {capacity} positions/seq ...")
            times = measure(model, config, precision, capacity, args.live, steps, dense)
            results["runs"].append({"system": system, "capacity_per_seq": capacity,
                                    "median_step_s": float(np.median(times)),
                                    "step_s": [float(t) for t in times]})
    base = {r["system"]: r["median_step_s"] for r in results["runs"]
            if r["capacity_per_seq"] == args.capacities[0]}
    table = make_table(f"Decode step vs cache capacity: 32 seqs x {args.live} live positions, "
                       f"{precision}", ("system", "capacity/seq", "cache rows",
                                        "step ms (median)", "× smallest"))
    for run in results["runs"]:
        run["ratio_to_smallest"] = run["median_step_s"] / base[run["system"]]
        table.add_row(run["system"], str(run["capacity_per_seq"]),
                      f"{32 * run['capacity_per_seq']:,}", f"{run['median_step_s'] * 1000:.1f}",
                      f"{run['ratio_to_smallest']:.2f}")
    console.print(machine_summary(results["machine"]), markup=False)
    console.print(table)
    paged = [r for r in results["runs"] if r["system"] == "paged"]
    results["target"] = {"paged_ratio_largest_vs_smallest": paged[-1]["ratio_to_smallest"],
                         "limit": 1.2, "met": paged[-1]["ratio_to_smallest"] <= 1.2}
    write_json(args.output, results)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in ("paged", "dense-read"):
        runs = [r for r in results["runs"] if r["system"] == system]
        ax.plot([r["capacity_per_seq"] for r in runs], [r["median_step_s"] * 1000 for r in runs],
                "o-", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache capacity per sequence (positions)")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title(f"32 seqs x {args.live} live positions, {precision}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output.with_suffix(".png"), dpi=120)
    console.print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
