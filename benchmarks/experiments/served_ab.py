#!/usr/bin/env python
"""Served A/B of two or more source trees (say, two commits) on one export: every tree's
`tokenserve serve` starts once and stays warm, then rounds of the headline's 32-stream load
(32-token prompts, 128 new tokens, greedy, ignore_eos, `tokenserve bench`) go to each server
in turn, the order rotating every round. Running the headline script once per tree instead
pays a start, an export and the one-stream phase per sample, so a slow minute of a shared
machine lands on one side; here each round samples every tree within a minute or two.

Besides tok/s it reads each server's /metrics around a round: the engine steps taken and the
tokens per step (vllm:iteration_tokens_total). Those do not depend on the machine's speed,
so two trees that schedule alike show the same counts, and a tok/s difference between them
is a per-step cost.

A tree is TAG=PATH: the repository root whose src/ the server imports (PYTHONPATH), e.g. a
`git worktree add --detach /tmp/before COMMIT`. The client is always this checkout's.

Run from the repository's root:
      python -m benchmarks.experiments.served_ab EXPORT_DIR before=/tmp/before after=. \\
          [--rounds 10] [--name NAME]
      (EXPORT_DIR: e.g. `tokenserve export gpt2-small --output /tmp/gpt2 --no-xla`)
Output: one line per sample, a table of medians, and
benchmarks/results/served-ab[-NAME].json with the machine's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from benchmarks.common import (TOKENSERVE, machine_info, machine_summary, make_console,
                               make_table, result_path, rotated, serve, spread, write_json)

STEP_METRICS = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
                "vllm:generation_tokens_total")


def engine_counts(url: str) -> dict[str, float]:
    """The step and token counters of the server at `url`, summed over their labels."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {name: sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith(name)) for name in STEP_METRICS}


def load_round(url: str, concurrency: int, num_prompts: int) -> dict:
    """One `tokenserve bench` run of the headline workload against `url`: its result."""
    out = Path(tempfile.mkdtemp(prefix="served-ab-"))
    try:
        subprocess.run([TOKENSERVE, "bench", "--base-url", url, "--model", "gpt2",
                        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                        "--random-input-len", "32", "--random-output-len", "128",
                        "--ignore-eos", "--disable-tqdm", "--result-dir", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads((out / "results.json").read_text())["runs"][0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def sample(url: str, concurrency: int, num_prompts: int) -> dict:
    before = engine_counts(url)
    run = load_round(url, concurrency, num_prompts)
    after = engine_counts(url)
    steps = after[STEP_METRICS[0]] - before[STEP_METRICS[0]]
    return {"tok_s": run["output_throughput"], "ttft_p50_ms": run["p50_ttft_ms"],
            "itl_p50_ms": run["p50_itl_ms"], "itl_p99_ms": run["p99_itl_ms"], "steps": steps,
            "tokens_per_step": (after[STEP_METRICS[1]] - before[STEP_METRICS[1]]) / max(steps, 1),
            "failed": run["failed"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=Path, help="model base path every tree serves")
    parser.add_argument("trees", nargs="+", help="TAG=PATH: a repository root to serve from")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--name", default="")
    args = parser.parse_args(argv)
    trees = dict(tree.split("=", 1) for tree in args.trees)
    console = make_console()
    info = machine_info()
    console.print(machine_summary(info))
    servers = {}
    try:
        for tag, root in trees.items():  # one at a time: kernel builds do not overlap
            env = dict(os.environ, PYTHONPATH=str(Path(root).resolve() / "src"))
            server = serve(["--model_name", "gpt2", "--model_base_path", str(args.export_dir)],
                           f"served-ab-{tag}.log", env)
            servers[tag] = server
            server.wait_until_serving(timeout_s=1800)
            load_round(server.url, args.concurrency, args.concurrency)  # every bucket traced
            console.print(f"{tag} ({root}) serving")
        samples = {tag: [] for tag in trees}
        for round_index in range(args.rounds):
            order = rotated(list(trees), round_index)
            for tag in order[::-1] if round_index % 2 else order:
                result = sample(servers[tag].url, args.concurrency, args.num_prompts)
                samples[tag].append(result)
                console.print(json.dumps({"round": round_index, "tag": tag, **result}))
    finally:
        for server in servers.values():
            server.stop()
    table = make_table(f"{args.concurrency} streams, medians of {args.rounds} rounds",
                       ["tree", "tok/s", "min-max", "ITL p50 ms", "steps", "tokens/step"],
                       left=("tree",))
    report = {"trees": trees, "machine": info, "samples": samples, "medians": {}}
    for tag, runs in samples.items():
        tok_s = spread(r["tok_s"] for r in runs)
        report["medians"][tag] = tok_s
        table.add_row(tag, f"{tok_s['median']:.1f}", f"{tok_s['min']:.0f}-{tok_s['max']:.0f}",
                      f"{spread(r['itl_p50_ms'] for r in runs)['median']:.1f}",
                      f"{spread(r['steps'] for r in runs)['median']:.0f}",
                      f"{spread(r['tokens_per_step'] for r in runs)['median']:.2f}")
    console.print(table)
    path = write_json(result_path("served-ab", args.name), report)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
