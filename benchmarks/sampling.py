#!/usr/bin/env python
"""What a sampled token costs: the engine's sampler alone, and decoding sampled against greedy.

1. The sampler (engine/sampler.py) on one row of logits, per vocabulary size and
   distribution: "flat" (logits N(0, 1): a random model's, where a draw lands past the 256
   likeliest tokens on nearly every token and the whole vocabulary is walked most likely
   first) and "peaked" (N(0, 4): closer to a trained model's). Each case runs the sampler as
   it is and, as the named baseline, the same sampler ordering by np.lexsort, sorting the
   whole vocabulary whenever a draw lands past the 256 likeliest tokens, and sorting the
   top-p nucleus (what it did before `descending`, `_pick_past_head` and `_pick_in_nucleus`),
   alternating, `--rounds` times; the table gives
   median microseconds per token and their ratio. Both must pick the same tokens: the
   script checks it. Plain temperature sampling draws by Gumbel noise now (the argmax of
   logits + T x noise), so "temperature 1" picks other tokens than the baseline's walk from
   the same distribution (not checked), and "temperature 1, walk" times the walk it used
   before, which top-k rows and speculative checks still take (checked).
2. With `--model EXPORT`: in-process `tokenserve.LLM`, 1 and 32 sequences of 32 random
   prompt tokens each, 128 new tokens, greedy against temperature 1 against temperature 0.8
   with top_p 0.9 (seeded), alternating, `--rounds` times: median output tok/s and sampled /
   greedy.

Output: a table and benchmarks/results/sampling[-NAME].json with the machine's flags.

    python benchmarks/sampling.py [--model /tmp/headline/gpt2-int8] [--rounds 5] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from machine import machine_info, machine_summary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=None if sys.stdout.isatty() else 140)
PARAMS = {"temperature 1": dict(temperature=1.0),
          "temperature 1, walk": dict(temperature=1.0),
          "top_p 0.9": dict(temperature=0.8, top_p=0.9),
          "top_k 50": dict(temperature=0.7, top_k=50)}
WALKS = {"temperature 1, walk"}  # plain temperature sampling forced to walk


def lexsort_descending(probs, ids=None):
    """The baseline order: the same as sampler.descending, by np.lexsort."""
    ids = np.arange(probs.size) if ids is None else ids
    return ids[np.lexsort((ids, -probs))]


def time_sampler(logits: np.ndarray, params: dict, tokens: int, by_noise: bool = True
                 ) -> tuple[float, list[int]]:
    """(microseconds per token, the picks) of a seeded sampler over `tokens` draws;
    by_noise False: plain temperature sampling walks the distribution instead."""
    from tokenserve.engine.sampler import SequenceSampler
    from tokenserve.sampling import SamplingParams

    class Walking(SamplingParams):
        samples_by_noise = False

    kind = SamplingParams if by_noise else Walking
    sampler = SequenceSampler(kind(seed=7, **params), 0, logits.size, [1])
    picks = []
    started = time.perf_counter()
    for _ in range(tokens):
        picks.append(sampler.sample(logits))
    return (time.perf_counter() - started) / tokens * 1e6, picks


def sampler_cases(rounds: int, tokens: int) -> list[dict]:
    from tokenserve.engine import sampler as module

    sampler_class = module.SequenceSampler
    current = module.descending, module._pick_past_head, sampler_class._pick_in_nucleus
    rows = []
    rng = np.random.default_rng(0)
    for vocab in (49152, 50257):
        for shape, scale in (("flat", 1.0), ("peaked", 4.0)):
            logits = rng.normal(0.0, scale, vocab).astype(np.float32)
            for label, params in PARAMS.items():
                now, before, same = [], [], True
                for _ in range(rounds):
                    module.descending = lexsort_descending
                    module._pick_past_head = lambda *args: None  # always the full sort
                    sampler_class._pick_in_nucleus = lambda *args: None  # sort the nucleus
                    took, old_picks = time_sampler(logits, params, tokens, by_noise=False)
                    before.append(took)
                    (module.descending, module._pick_past_head,
                     sampler_class._pick_in_nucleus) = current
                    took, picks = time_sampler(logits, params, tokens,
                                               by_noise=label not in WALKS)
                    now.append(took)
                    same = same and picks == old_picks
                rows.append({"vocab": vocab, "logits": shape, "params": label,
                             "us_per_token": statistics.median(now),
                             "baseline_us_per_token": statistics.median(before),
                             "speedup": statistics.median(b / n for b, n in zip(before, now)),
                             # drawn by noise: other draws from the same distribution
                             "same_tokens": same if "temperature 1" != label else None})
    module.descending, module._pick_past_head, sampler_class._pick_in_nucleus = current
    return rows


def engine_cases(model: str, rounds: int, seqs: list[int]) -> list[dict]:
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.llm import LLM
    from tokenserve.sampling import SamplingParams

    llm = LLM(model, EngineConfig(max_num_seqs=max(seqs)))
    rng = np.random.default_rng(1)
    kinds = {"greedy": dict(temperature=0.0), **{k: dict(v, seed=3) for k, v in PARAMS.items()
                                                 if k != "top_k 50" and k not in WALKS}}
    rows = []
    for num_seqs in seqs:
        prompts = [rng.integers(100, 10000, 32).tolist() for _ in range(num_seqs)]
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_ in range(rounds + 1):  # the first round warms every path up, untimed
            for kind, params in kinds.items():
                started = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True,
                                                            **params), use_tqdm=False)
                took = time.perf_counter() - started
                if round_:
                    rates[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / took)
            console.print(f"  {num_seqs} sequences: round {round_}/{rounds}", style="dim")
        greedy = statistics.median(rates["greedy"])
        rows += [{"model": model, "num_seqs": num_seqs, "decoding": kind,
                  "tok_s": statistics.median(values),
                  "vs_greedy": statistics.median(values) / greedy, "rounds": values}
                 for kind, values in rates.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an export to decode sampled and greedy in-process")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200, help="draws per sampler round")
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    info = machine_info()
    console.print(machine_summary(info))

    rows = sampler_cases(args.rounds, args.tokens)
    table = Table(title="one sampled token: the sampler, median us (baseline: lexsort, "
                        "full sorts)")
    for column in ("vocab", "logits", "params", "us/token", "baseline us/token", "speedup",
                   "same tokens"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["vocab"]), r["logits"], r["params"], f"{r['us_per_token']:.0f}",
                      f"{r['baseline_us_per_token']:.0f}", f"{r['speedup']:.2f}x",
                      {True: "yes", False: "NO", None: "(other draws)"}[r["same_tokens"]])
    console.print(table)
    result = {"machine": info, "sampler": rows}

    if args.model:
        engine = engine_cases(args.model, args.rounds, args.seqs)
        table = Table(title=f"128 new tokens per sequence, in-process: {args.model}")
        for column in ("sequences", "decoding", "output tok/s (median)", "x greedy"):
            table.add_column(column, justify="right")
        for r in engine:
            table.add_row(str(r["num_seqs"]), r["decoding"], f"{r['tok_s']:.1f}",
                          f"{r['vs_greedy']:.2f}x")
        console.print(table)
        result["engine"] = engine

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"sampling{'-' + args.name if args.name else ''}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {path}")
    if any(r["same_tokens"] is False for r in rows):
        sys.exit("the sampler picked other tokens than the lexsort baseline")


if __name__ == "__main__":
    main()
