#!/usr/bin/env python
"""Did the engine get slower? Two source trees of tokenserve, side by side, round by round.

Each round runs, for each model and each tree in turn, a fresh process that loads the model
with `tokenserve.LLM` from that tree (PYTHONPATH) and decodes prompts of 32 random tokens,
128 new tokens each, greedy, eos ignored: one prompt (best of two), the same sampled at
temperature 0.8 ("1 sampled", as most chat requests are: before 2026-12-05 such a row read
the whole LM head, since then it takes the head screen with its noise), then 8, 16
and 32 at once, and 32 sampled; and "prefill": one 32-token prompt for one new token, ten times, as prompt
tokens per second over the median call (the engine's part of the time to first token).
The two trees alternate inside a round, so both see the same minutes of this noisy machine;
the table gives each tree's median and the median of the per-round ratios (after / before).

The "before" tree is usually a git worktree of an older commit:

    git worktree add /tmp/before <commit>
    python benchmarks/versions_ab.py --before /tmp/before \\
        --model auto=/tmp/ab/before-float32:/tmp/headline/gpt2-float32 \\
        --model int8=/tmp/ab/before-int8:/tmp/headline/gpt2-int8

Each --model is NAME=BEFORE_EXPORT:AFTER_EXPORT: each tree serves the export its own code
wrote (`tokenserve export gpt2-small --no-xla [--quantize int8]`), since the export format may
differ between them. A NAME of auto, float32 or bfloat16 is passed as `precision`. Writes
benchmarks/results/versions-ab.json (or --output) with the machine's CPU flags and ISA caps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, spread,
                    write_json)

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
console = make_console(150)

WORKER = """
import json, sys, time
import numpy as np
from tokenserve import LLM, SamplingParams
import tokenserve
precision = sys.argv[2]
kwargs = {"precision": precision} if precision in ("auto", "float32", "bfloat16") else {}
llm = LLM(sys.argv[1], max_num_seqs=32, **kwargs)
params = SamplingParams(max_tokens=128, ignore_eos=True)
# sampled, as most chat requests are (no top-p cut): a Gumbel draw, screened since 2026-12-05
sampled = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.8, seed=0)
rng = np.random.default_rng(0)
def run(n, params=params):
    prompts = [[int(t) for t in rng.integers(0, 50000, 32)] for _ in range(n)]
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
def prefill():
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(10):
        prompt = [[int(t) for t in rng.integers(0, 50000, 32)]]
        started = time.perf_counter()
        llm.generate(prompt, one, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return 32 / float(np.median(times))
run(1); run(32); prefill()
print(json.dumps({"1": max(run(1) for _ in range(2)),
                  "1 sampled": max(run(1, sampled) for _ in range(2)), "8": run(8), "16": run(16),
                  "32": run(32), "32 sampled": run(32, sampled), "prefill": prefill(),
                  "precision": str(llm.engine.runner.precision),
                  "source": tokenserve.__file__}))
"""
POINTS = ("1", "1 sampled", "8", "16", "32", "32 sampled", "prefill")


def run_worker(tree: Path, export: str, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([PYTHON, "-c", WORKER, export, name], check=True, capture_output=True,
                         text=True, env=env, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def commit(tree: Path) -> str:
    """The tree's git commit (with "+dirty" when it has uncommitted changes), or "?"."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=tree, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the older source tree")
    parser.add_argument("--after", type=Path, default=ROOT, help="the newer one (this tree)")
    parser.add_argument("--model", action="append", required=True,
                        metavar="NAME=BEFORE_EXPORT:AFTER_EXPORT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS / "versions-ab.json")
    args = parser.parse_args(argv)
    models = {}
    for spec in args.model:
        name, _, pair = spec.partition("=")
        before, _, after = pair.partition(":")
        if not (name and before and after):
            parser.error(f"--model {spec!r}: expected NAME=BEFORE_EXPORT:AFTER_EXPORT")
        models[name] = {"before": before, "after": after}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    info = machine_info()
    console.print(machine_summary(info))

    from rich.progress import Progress

    rounds: list[dict] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(models) * 2)
        for index in range(args.rounds):
            result: dict = {}
            for name, exports in models.items():
                # alternate which tree goes first, so neither always gets the warmer minute
                order = ("before", "after") if index % 2 == 0 else ("after", "before")
                for side in order:
                    result.setdefault(name, {})[side] = run_worker(trees[side], exports[side],
                                                                   name)
                    progress.advance(task)
            rounds.append(result)
            console.print(f"round {index + 1}: " + "  ".join(
                f"{name} " + " ".join(f"{p}:{r['before'][p]:.1f}->{r['after'][p]:.1f}"
                                      for p in POINTS) for name, r in result.items()))

    summary: dict = {}
    table = make_table("tokenserve.LLM output tok/s (prefill: prompt tok/s), before -> after "
                       "(medians over rounds)", ("model", "precision", "sequences", "before",
                                                 "after", "after/before", "min-max ratio"),
                       left=("model", "precision"))
    for name in models:
        for point in POINTS:
            before = [r[name]["before"][point] for r in rounds]
            after = [r[name]["after"][point] for r in rounds]
            ratio = spread(a / b for a, b in zip(after, before))
            summary.setdefault(name, {})[point] = {
                "before": statistics.median(before), "after": statistics.median(after),
                **{f"ratio_{k}": v for k, v in ratio.items()}}
            precision = (f"{rounds[0][name]['before']['precision']} -> "
                         f"{rounds[0][name]['after']['precision']}")
            table.add_row(name, precision, point, f"{statistics.median(before):.1f}",
                          f"{statistics.median(after):.1f}", f"{ratio['median']:.2f}x",
                          f"{ratio['min']:.2f}-{ratio['max']:.2f}")
    console.print(table)
    write_json(args.output, {
        "machine": info, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "trees": {side: {"path": str(tree), "commit": commit(tree)}
                  for side, tree in trees.items()},
        "models": models, "rounds": rounds, "summary": summary})
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
