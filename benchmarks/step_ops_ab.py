#!/usr/bin/env python
"""Small ops folded into the step, A/B in one process: the step as the engine builds it
against the same step with some of its fused small ops swapped back for the graph ops they
replaced (`--off`, default all of them):

  kv-write    the attention op that stores the layer's new K/V rows itself
              (TokenservePagedWriteDecodeAttention) -> a clip, a cast and a
              ResourceScatterUpdate per cache, then the read-only attention op (and, at
              one decode group, a slice of q and a concat of zero rows after);
  split-rope  the QKV split with RoPE in one op (TokenserveSplitRope) -> a split, reshapes
              and RoPE's split, negation, concat, products and sum for each of q and k.

A change worth a few % of a step is below what separate processes on these VMs can resolve
(benchmarks/versions_ab.py's rounds of one int8 stream spread 0.93-1.12x on one build), so
the engines live in one process over the same export, traced with the ops swapped back or
not. Four of them, loaded in the order before, after, after, before (before: swapped back):
an engine loaded later ran 5 % faster than the same engine loaded earlier here
(one int8 stream, 2-core Xeon), and the mirrored order cancels that. Every round runs all
four in an order that rotates by round; each generates one 128-token greedy stream from a
32-token prompt (eos ignored). A variant's rate in a round is the mean of its two engines';
the table gives each variant's median and the median of the per-round ratios.

    python benchmarks/step_ops_ab.py /tmp/headline/gpt2-int8 --rounds 10 --off kv-write
    ONEDNN_MAX_CPU_ISA=AVX2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 TOKENSERVE_KERNELS_MARCH=avx2 \\
        TF_ENABLE_ONEDNN_OPTS=0 python benchmarks/step_ops_ab.py /tmp/headline/gpt2-float32

Writes benchmarks/results/step-ops-ab.json (or --output) with the machine's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_summary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
console = Console()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an export (tokenserve export ... --no-xla)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--off", nargs="+", choices=("kv-write", "split-rope"),
                        default=["kv-write", "split-rope"],
                        help="what the baseline engines run as graph ops again")
    parser.add_argument("--output", type=Path, default=RESULTS / "step-ops-ab.json")
    args = parser.parse_args(argv)

    from tokenserve import LLM, SamplingParams
    from tokenserve.engine.config import EngineConfig
    from tokenserve.kernels import dense as kdense
    from tokenserve.kernels import paged_attention as pa

    if not pa.is_compiled():
        console.print("the paged attention op is not compiled here: nothing to compare")
        return 1
    info = machine_info()
    console.print(machine_summary(info))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = [list(range(100, 132))]

    fused = {"kv-write": (pa, "paged_write_decode_attention",
                          pa.paged_write_decode_attention_fallback),
             "split-rope": (kdense, "split_rope", kdense.split_rope_fallback)}
    engines = []  # (variant, LLM), loaded before, after, after, before
    for name in ("before", "after", "after", "before"):
        swapped = [(module, attr, getattr(module, attr), graph_ops)
                   for off, (module, attr, graph_ops) in fused.items()
                   if name == "before" and off in args.off]
        for module, attr, _, graph_ops in swapped:  # read when the steps are traced
            setattr(module, attr, graph_ops)
        try:
            llm = LLM(args.model, EngineConfig(precision=args.precision,
                                               kv_cache_memory_bytes=256 << 20))
            llm.generate(prompt, params)  # traces the steps it runs
        finally:
            for module, attr, op, _ in swapped:
                setattr(module, attr, op)
        ops = {op.type for step in llm.engine.runner.step._concrete.values()
               for op in step.concrete.graph.get_operations()}
        engines.append((name, llm))
        console.print(f"{name}: step graphs hold {len(ops)} op types, "
                      f"{sorted(t for t in ops if 'Tokenserve' in t or 'Scatter' in t)}")

    rates = {"before": [], "after": []}
    for round_ in track(range(args.rounds), description="rounds", console=console):
        shift = round_ % len(engines)
        this_round = {"before": [], "after": []}
        for name, llm in engines[shift:] + engines[:shift]:
            started = time.perf_counter()
            llm.generate(prompt, params)
            this_round[name].append(args.tokens / (time.perf_counter() - started))
        for name, values in this_round.items():
            rates[name].append(statistics.mean(values))
    ratios = [after / before for before, after in zip(rates["before"], rates["after"])]

    table = Table(title=f"one stream, {args.model} ({args.precision}), tok/s; before: "
                        f"{' and '.join(args.off)} as graph ops")
    for column in ("before", "after", "after / before", "min-max"):
        table.add_column(column, justify="right")
    table.add_row(f"{statistics.median(rates['before']):.1f}",
                  f"{statistics.median(rates['after']):.1f}",
                  f"{statistics.median(ratios):.3f}x", f"{min(ratios):.3f}-{max(ratios):.3f}")
    console.print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "workload": {"model": args.model, "precision": args.precision, "tokens": args.tokens,
                     "prompt_tokens": 32, "rounds": args.rounds, "off": args.off},
        "machine": info, "tok_s": rates, "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios)}, indent=1))
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
