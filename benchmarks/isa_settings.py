#!/usr/bin/env python
"""Does any CPU setting cost the engine here? One prompt in process, under each setting in turn.

On a CPU with AVX-512 (and bf16 or AMX) the engine runs the custom ops built for it
(-march=native), TensorFlow's oneDNN ops and XLA's AVX-512 code; the caps that stand in for an
AVX2-only CPU turn each of those off. This runs `tokenserve.LLM` on one export under each
setting, each in a fresh process, in rounds whose order rotates, so that the VM's drift within
the hour (often 10-40 %) hits every setting alike. Per process: one warm-up prompt, then four
timed prompts (32 random tokens, 128 new, greedy, eos ignored); the process's figure is their
median.

  native        nothing set
  march-avx2    TOKENSERVE_KERNELS_MARCH=avx2 (the custom ops built for AVX2 + FMA + F16C)
  no-onednn     TF_ENABLE_ONEDNN_OPTS=0
  xla-avx2      XLA_FLAGS=--xla_cpu_max_isa=AVX2
  full-cap      all of the above and ONEDNN_MAX_CPU_ISA=AVX2 (the stand-in)

Prints a table (median tok/s per setting and each setting's ratio to native, taken round by
round), writes benchmarks/results/isa-settings.json (or --output) with the CPU flags.

    .venv/bin/python benchmarks/isa_settings.py /tmp/headline/gpt2-int8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine_info, machine_summary  # noqa: E402

RESULTS = HERE / "results"
console = Console(width=None if sys.stdout.isatty() else 150)

WORKER = r"""
import json, sys, time
import numpy as np
from tokenserve import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=32)
params = SamplingParams(max_tokens=128, ignore_eos=True)
rng = np.random.default_rng(0)
def run():
    prompt = [int(t) for t in rng.integers(0, 50000, 32)]
    started = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return len(out.outputs[0].token_ids) / (time.perf_counter() - started)
run()
runs = [run() for _ in range(4)]
print(json.dumps({"tok_s": sorted(runs)[len(runs) // 2], "runs": runs,
                  "precision": llm.engine.runner.precision}))
"""

STAND_IN = {"ONEDNN_MAX_CPU_ISA": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
            "TOKENSERVE_KERNELS_MARCH": "avx2", "TF_ENABLE_ONEDNN_OPTS": "0"}
SETTINGS = {
    "native": {},
    "march-avx2": {"TOKENSERVE_KERNELS_MARCH": "avx2"},
    "no-onednn": {"TF_ENABLE_ONEDNN_OPTS": "0"},
    "xla-avx2": {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"},
    "full-cap": STAND_IN,
}
CAP_VARS = tuple(STAND_IN)  # every variable a setting may set


def run_setting(model: str, setting: str) -> dict:
    # Start from an uncapped environment, so "native" is native even when the caller is capped.
    env = {k: v for k, v in os.environ.items() if k not in CAP_VARS}
    env.update(SETTINGS[setting], TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", WORKER, model], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an export's base directory (e.g. /tmp/headline/gpt2-int8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--output", type=Path, default=RESULTS / "isa-settings.json")
    args = parser.parse_args(argv)

    info = machine_info()
    console.print(machine_summary(info))
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        shift = r % len(args.settings)
        order = args.settings[shift:] + args.settings[:shift]
        this_round = {}
        for setting in order:
            this_round[setting] = run_setting(args.model, setting)
        rounds.append(this_round)
        console.print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{s} {this_round[s]['tok_s']:.1f}" for s in args.settings))

    table = Table(title=f"one prompt in process, {Path(args.model).name}, "
                        f"{args.rounds} rotating rounds (tok/s)")
    for column in ("setting", "precision", "median", "min", "max", "/ native, median",
                   "min", "max"):
        table.add_column(column, justify="left" if column in ("setting", "precision")
                         else "right")
    summary = {}
    for setting in args.settings:
        figures = [r[setting]["tok_s"] for r in rounds]
        row = {"median": statistics.median(figures), "min": min(figures), "max": max(figures),
               "precision": rounds[0][setting]["precision"]}
        cells = [setting, row["precision"], f"{row['median']:.1f}", f"{row['min']:.1f}",
                 f"{row['max']:.1f}"]
        if "native" in args.settings:
            ratios = [r[setting]["tok_s"] / r["native"]["tok_s"] for r in rounds]
            row["ratio_to_native"] = {"median": statistics.median(ratios),
                                      "min": min(ratios), "max": max(ratios)}
            cells += [f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}x",
                      f"{max(ratios):.2f}x"]
        else:
            cells += ["", "", ""]
        table.add_row(*cells)
        summary[setting] = row
    console.print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "workload": {"model": args.model, "prompt_tokens": 32, "new_tokens": 128,
                     "greedy": True, "ignore_eos": True, "timed_prompts_per_process": 4},
        "settings": {s: SETTINGS[s] for s in args.settings},
        "machine": info, "summary": summary, "rounds": rounds}, indent=2))
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
