#!/usr/bin/env python
"""Does a decode step of a sliding-window model stay flat as the context grows?

Model: a Llama-shaped Transformer (random weights; 6 layers, width 512, 8 query / 2 KV heads)
in the engine's runner, 4 sequences decoding at contexts of 1k to 8k positions. The contexts
are set up without a prefill (the cache rows hold zeros: attention costs the same whatever
the values), so the run takes minutes, not the hour 4 x 8k positions of prefill would.

Systems, in one run, on one model's weights:
  global       every layer attends to its whole context (Llama, Qwen).
  windowed     every layer attends to its last --window positions (Mistral): the paged
               attention op reads only those rows, and the blocks behind the window go back
               to the pool, so the KV memory a sequence holds is flat too.
  interleaved  five windowed layers to one global (Gemma 3's pattern): a sixth of the
               attention grows with the context; blocks stay (the global layer reads them).

Target: windowed step at 8k / at 1k <= 1.2. Output: a table (under a one-line CPU summary),
benchmarks/results/windowed_decode.json and windowed_decode.png.

Run:  python benchmarks/windowed_decode.py [--contexts 1024 2048 4096 8192] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, pyplot,
                    rotated, write_json)

console = make_console(120)
LAYERS = 6


def architecture(system: str, window: int, max_context: int):
    from tokenserve.config import llama_config

    base = llama_config(vocab_size=8192, max_seq_len=max_context + 64, hidden_size=512,
                        num_layers=LAYERS, num_heads=8, num_kv_heads=2,
                        intermediate_size=1376)
    windows = {"global": (), "windowed": (window,) * LAYERS,
               "interleaved": (window,) * (LAYERS - 1) + (0,)}[system]
    return dataclasses.replace(base, sliding_windows=windows)


def measure(system: str, window: int, context: int, max_context: int, steps: int,
            num_seqs: int) -> dict:
    """Median decode step time and KV memory held, `num_seqs` sequences at `context`."""
    from tokenserve.config import GenerationConfig
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.request import Request
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput
    from tokenserve.model import build_model
    from tokenserve.sampling import SamplingParams

    arch = architecture(system, window, max_context)
    model = build_model(arch, seed=0)  # the same seed: the same weights for every system
    config = GenerationConfig(model=arch, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    engine_config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=256,
                                 precision="float32",
                                 max_cache_tokens=num_seqs * (max_context + 64))
    runner = ModelRunner(model, config, engine_config)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(num_seqs):
        seq = Request(f"r{i}", rng.integers(3, 8000, size=context).tolist(),
                      SamplingParams(max_tokens=steps + 8)).seqs[0]
        assert runner.cache.reserve(seq, context - 1)  # as if its prompt were prefilled
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    times, held = [], []
    for step in range(steps + 3):  # three warm-up steps trace and compile
        for seq in seqs:
            assert runner.cache.reserve(seq, 1)
        out = SchedulerOutput(scheduled=[ScheduledSeq.of(seq, 1) for seq in seqs])
        started = time.perf_counter()
        runner.execute(out)
        if step >= 3:
            times.append(time.perf_counter() - started)
        for seq in seqs:
            seq.num_computed_tokens += 1
            seq.token_ids.append(5)
        held.append(sum(1 for seq in seqs for block in seq.block_ids if block))
    bytes_per_block = (runner.cache.block_size * LAYERS * 2 * arch.num_kv_heads * arch.head_dim
                       * 4)  # float32 keys and values
    return {"system": system, "context": context, "median_step_s": float(np.median(times)),
            "step_s": [float(t) for t in times],
            "kv_mib_held": held[-1] * bytes_per_block / 2**20,
            "kv_blocks_held": held[-1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "windowed_decode.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    systems = ["global", "windowed", "interleaved"]
    max_context = max(args.contexts)
    results = {"workload": {"model": f"llama-shaped, {LAYERS} layers, width 512, 8/2 heads "
                                     f"(random)", "precision": "float32",
                            "num_seqs": args.seqs, "window": args.window},
               "machine": {**machine_info(), "loadavg": list(os.getloadavg())},
               "runs": []}
    for round_index, context in enumerate(args.contexts):
        for system in rotated(systems, round_index):  # a slow minute falls on each in turn
            console.print(f"{system}: {args.seqs} x {context} positions ...")
            results["runs"].append(measure(system, args.window, context, max_context,
                                           args.steps, args.seqs))
    first = {r["system"]: r["median_step_s"] for r in results["runs"]
             if r["context"] == args.contexts[0]}
    table = make_table(f"Decode step vs context: {args.seqs} seqs, window {args.window}, "
                       f"float32", ("system", "context", "step ms (median)",
                                    f"× at {args.contexts[0]}", "KV MiB held"), left=("system",))
    for system in systems:
        for run in (r for r in results["runs"] if r["system"] == system):
            run["ratio_to_first"] = run["median_step_s"] / first[system]
            table.add_row(system, str(run["context"]), f"{run['median_step_s'] * 1000:.1f}",
                          f"{run['ratio_to_first']:.2f}", f"{run['kv_mib_held']:.1f}")
    console.print(machine_summary(results["machine"]), markup=False)
    console.print(table)
    windowed = [r for r in results["runs"] if r["system"] == "windowed"]
    last = max(windowed, key=lambda r: r["context"])
    results["target"] = {"windowed_ratio_largest_vs_smallest": last["ratio_to_first"],
                         "limit": 1.2, "met": last["ratio_to_first"] <= 1.2}
    write_json(args.output, results)

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system in systems:
        runs = sorted((r for r in results["runs"] if r["system"] == system),
                      key=lambda r: r["context"])
        contexts = [r["context"] for r in runs]
        axes[0].plot(contexts, [r["median_step_s"] * 1000 for r in runs], "o-", label=system)
        axes[1].plot(contexts, [r["kv_mib_held"] for r in runs], "o-", label=system)
    for ax, label in zip(axes, ("decode step (ms, median)", "KV cache held (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (positions)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.seqs} sequences, window {args.window}")
    fig.tight_layout()
    fig.savefig(args.output.with_suffix(".png"), dpi=120)
    console.print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
