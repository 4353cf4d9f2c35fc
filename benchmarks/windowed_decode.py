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

Every (system, context) runner is built first, then each round steps each of them once, the
order rotating, so a shared machine's slow minutes fall on every context alike.

Run:  python benchmarks/windowed_decode.py [--contexts 1024 2048 4096 8192] [--steps 30]
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


class Decoder:
    """One system at one context: a runner on the system's model and `num_seqs` sequences
    whose contexts are reserved as if prefilled, stepped one decode token at a time."""

    def __init__(self, system: str, model, arch, context: int, steps: int, num_seqs: int):
        from tokenserve.config import GenerationConfig
        from tokenserve.engine.config import EngineConfig
        from tokenserve.engine.request import Request
        from tokenserve.engine.runner import ModelRunner
        from tokenserve.sampling import SamplingParams

        self.system, self.context, self.arch = system, context, arch
        config = GenerationConfig(model=arch, bos_token_id=0, eos_token_id=1, pad_token_id=2)
        engine_config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=256,
                                     precision="float32",
                                     max_cache_tokens=num_seqs * (context + steps + 64))
        self.runner = ModelRunner(model, config, engine_config)
        rng = np.random.default_rng(0)
        self.seqs = []
        for i in range(num_seqs):
            seq = Request(f"r{i}", rng.integers(3, 8000, size=context).tolist(),
                          SamplingParams(max_tokens=steps + 8)).seqs[0]
            assert self.runner.cache.reserve(seq, context - 1)  # as if prefilled
            seq.num_computed_tokens = context - 1
            self.seqs.append(seq)
        self.times: list[float] = []

    def step(self, timed: bool = True) -> None:
        from tokenserve.engine.scheduler_output import ScheduledSeq, SchedulerOutput

        for seq in self.seqs:
            assert self.runner.cache.reserve(seq, 1)
        out = SchedulerOutput(scheduled=[ScheduledSeq.of(seq, 1) for seq in self.seqs])
        started = time.perf_counter()
        self.runner.execute(out)
        if timed:
            self.times.append(time.perf_counter() - started)
        for seq in self.seqs:
            seq.num_computed_tokens += 1
            seq.token_ids.append(5)

    def result(self) -> dict:
        held = sum(1 for seq in self.seqs for block in seq.block_ids if block)
        bytes_per_block = (self.runner.cache.block_size * LAYERS * 2 * self.arch.num_kv_heads
                           * self.arch.head_dim * 4)  # float32 keys and values
        return {"system": self.system, "context": self.context,
                "median_step_s": float(np.median(self.times)),
                "step_s": [float(t) for t in self.times],
                "kv_mib_held": held * bytes_per_block / 2**20, "kv_blocks_held": held}


def measure(systems, contexts, window: int, steps: int, num_seqs: int) -> list[dict]:
    """Median decode step time and KV memory held of every (system, context). Every runner
    is built first; then each round steps each of them once, in an order that rotates, so a
    slow minute of a shared machine falls on every context alike."""
    from tokenserve.model import build_model

    max_context = max(contexts)
    decoders = []
    for system in systems:
        arch = architecture(system, window, max_context)
        model = build_model(arch, seed=0)  # the same seed: the same weights for every system
        for context in contexts:
            console.print(f"{system}: {num_seqs} x {context} positions ...")
            decoders.append(Decoder(system, model, arch, context, steps, num_seqs))
            for _ in range(3):  # warm-up steps trace and compile
                decoders[-1].step(timed=False)
    for round_index in range(steps):
        for decoder in rotated(decoders, round_index):
            decoder.step()
    return [decoder.result() for decoder in decoders]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "windowed_decode.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    systems = ["global", "windowed", "interleaved"]
    results = {"workload": {"model": f"llama-shaped, {LAYERS} layers, width 512, 8/2 heads "
                                     f"(random)", "precision": "float32",
                            "num_seqs": args.seqs, "window": args.window},
               "machine": {**machine_info(), "loadavg": list(os.getloadavg())},
               "runs": []}
    results["runs"] = measure(systems, args.contexts, args.window, args.steps, args.seqs)
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
