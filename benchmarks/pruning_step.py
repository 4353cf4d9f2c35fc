"""The engine's decode step, unpruned against pruned: what removing attention heads buys.

Pruning heads removes their slices of the QKV and output projections (a small part of the
weights) and their share of the KV cache, which every decode step reads in full. So the
gain shows where the cache reads dominate: many sequences with long contexts. At batch 1
on a short context the step is weights plus fixed per-step costs, and barely moves.

    tokenserve optimize gpt2-small --output DIR --variants fp32,pruned-heads25-ft ...
    python benchmarks/pruning_step.py DIR/models/fp32/1 DIR/models/pruned-heads25-ft/1 \\
        --name gpt2-small

For each shape (`--shapes SEQSxCONTEXT,...`), every model serves SEQS prompts of CONTEXT
tokens with `--new-tokens` greedy tokens each, in `--rounds` rounds alternating between
the models (this VM's speed drifts). A step's time is the engine's own measure of it (its
StepStats, the model call and the KV moves, not the Python around it); only steps that
decode all SEQS sequences and prefill nothing count. Prints a table with medians and
writes benchmarks/results/pruning-step[-NAME].json with the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from common import make_console, make_table, machine_summary, result_path, write_result
from step_times import StepTimes


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        seqs, context = item.lower().split("x")
        shapes.append((int(seqs), int(context)))
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs=2, metavar="VERSION_DIR",
                        help="the reference SavedModel version dir, then the pruned one")
    parser.add_argument("--name", default="", help="suffix of the results file")
    parser.add_argument("--shapes", default="1x64,32x512", help="SEQSxCONTEXT,... "
                        "(default 1x64,32x512)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens per sequence; must outlast the prefill's steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="float32",
                        help="the engines' precision (default float32; auto: what serve picks "
                             "for this CPU)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import numpy as np
    from tqdm import tqdm

    from tokenserve import LLM
    from tokenserve.engine.config import EngineConfig
    from tokenserve.sampling import SamplingParams

    shapes = parse_shapes(args.shapes)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    results = []
    for seqs, context in shapes:
        config = EngineConfig(precision=args.precision, max_num_seqs=seqs,
                              max_cache_tokens=seqs * (context + args.new_tokens + 16),
                              enable_prefix_caching=False)
        engines = {path: LLM(path, config) for path in args.models}
        computes_in = next(iter(engines.values())).engine.runner.precision
        vocab = next(iter(engines.values())).engine.config.model.vocab_size
        prompts = [rng.integers(10, vocab, context).tolist() for _ in range(seqs)]
        steps = {path: [] for path in args.models}
        for path, llm in engines.items():  # warm-up: traces and compiles this shape
            llm.generate(prompts, params, use_tqdm=False)
        work = [(r, path) for r in range(args.rounds) for path in args.models]
        for _, path in tqdm(work, desc=f"{seqs}x{context}", unit="run", dynamic_ncols=True):
            llm = engines[path]
            sink = StepTimes()
            llm.engine.stats = sink
            llm.generate(prompts, params, use_tqdm=False)
            steps[path] += sink.durations(seqs, 0)
        del engines
        if not all(steps.values()):
            raise SystemExit(f"{seqs}x{context}: no step decoded all {seqs} sequences at once; "
                             f"raise --new-tokens above the prefill's steps "
                             f"({seqs * context // config.max_num_batched_tokens} here)")
        reference = statistics.median(steps[args.models[0]])
        for path in args.models:
            median = statistics.median(steps[path])
            results.append({"model": path, "seqs": seqs, "context": context,
                            "decode_steps": len(steps[path]), "step_ms_median": 1e3 * median,
                            "step_ms_p10": 1e3 * float(np.percentile(steps[path], 10)),
                            "step_ms_p90": 1e3 * float(np.percentile(steps[path], 90)),
                            "ratio_to_reference": median / reference})

    table = make_table(f"engine decode step, {computes_in}",
                       ("model", "seqs x context", "steps", "median ms", "p10-p90 ms",
                        "vs first"), left=("model",))
    for r in results:
        label = Path(r["model"]).parent.name if Path(r["model"]).name.isdigit() else r["model"]
        table.add_row(label, f"{r['seqs']} x {r['context']}", str(r["decode_steps"]),
                      f"{r['step_ms_median']:.1f}",
                      f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}",
                      f"{r['ratio_to_reference']:.2f}x")
    console = make_console(80)
    console.print(table)
    out = result_path("pruning-step", args.name)
    info = write_result(out, new_tokens=args.new_tokens, rounds=args.rounds,
                        precision=computes_in, results=results)
    console.print(machine_summary(info))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
