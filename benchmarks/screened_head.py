#!/usr/bin/env python
"""The LM head's screens in the engine: greedy decode with an int8 screen, a float16 one, and
none.

`--precision bfloat16` runs the same float32 exports as bfloat16 engines, which screen
their head in int8 only (a float16 copy would be as large as the bfloat16 head).

For each exported float32 model, three in-process engines (`tokenserve.LLM`) on the same
export, two screening greedy steps of up to 8 rows (`max_screened_head_rows=8`, the
default) with an int8 copy of the head (`head_screen="int8"`, the default) and a float16
one, and one never screening (`0`), decode the same prompts (32 random tokens each,
greedy, `ignore_eos`), alternating in one process, `--rounds` times per batch size.
Reported: median output tok/s of each, the ratios (each round's, then their median),
whether every answer was the same tokens, and how many vocabulary entries per row each
screen had to compute again in float32 (recorded by engines of their own, not timed, whose
head reports them; a few means the screen ruled out all but a few).

Output: a table and benchmarks/results/screened-head[-NAME].json with the machine's flags.

    python benchmarks/screened_head.py /tmp/headline/gpt2-float32 [MORE_EXPORTS...] \
        [--seqs 1 2 4 8] [--rounds 3] [--tokens 64] [--precision float32] [--name NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import (make_console, make_table, machine_info, machine_summary, result_path,
                    rotated, write_json)

CANDIDATES: list[int] = []  # per screened row, appended from inside the step's head
_ORIGINAL: list = []  # ScreenedHead.__call__ while record_candidates has replaced it
SCREENS = ("int8", "float16")
RATIOS = [("int8", "plain"), ("float16", "plain"), ("int8", "float16")]


def record_candidates() -> None:
    """Wraps ScreenedHead.__call__ so each traced head also reports its candidate counts."""
    import numpy as np
    import tensorflow as tf

    from tokenserve.engine.step import head as screened_head

    original = screened_head.ScreenedHead.__call__

    def counting(self, x):
        approx, bound = self.bounds(x)
        floor = tf.reduce_max(approx - bound, axis=-1, keepdims=True)
        counts = tf.reduce_sum(tf.cast(approx + bound >= floor, tf.int32), -1)
        logged = tf.numpy_function(lambda c: (CANDIDATES.extend(int(n) for n in c),
                                              np.int32(0))[1], [counts], tf.int32)
        with tf.control_dependencies([logged]):
            return original(self, tf.identity(x))

    screened_head.ScreenedHead.__call__ = counting
    _ORIGINAL.append(original)


def restore_candidates() -> None:
    from tokenserve.engine.step import head as screened_head

    screened_head.ScreenedHead.__call__ = _ORIGINAL.pop()


def screens_for(precision: str) -> tuple[str, ...]:
    return SCREENS if precision == "float32" else ("int8",)


def ratios_for(precision: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in RATIOS if {a, b} <= {"plain", *screens_for(precision)}]


def bench_model(path: str, seqs: list[int], rounds: int, tokens: int,
                precision: str = "float32") -> dict:
    import numpy as np

    from tokenserve import LLM, SamplingParams

    screens = screens_for(precision)

    def engine(**knobs):
        return LLM(path, precision=precision, max_num_seqs=max(seqs), **knobs)

    engines = {screen: engine(head_screen=screen) for screen in screens}
    engines["plain"] = engine(max_screened_head_rows=0)
    # counted in engines of their own: the count is a Python callback in the graph, which
    # costs a step more than the screen saves on a small model
    record_candidates()
    counting = {screen: engine(head_screen=screen) for screen in screens}
    for llm in counting.values():
        llm.engine.runner.warm_up_heads()  # traced now, with the count in the graph
    restore_candidates()
    vocab = engines["plain"].engine.runner.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    rows = []
    for num_seqs in seqs:
        rates = {name: [] for name in engines}
        same = True
        candidates = {}
        counted = [[int(t) for t in rng.integers(100, vocab - 100, 32)] for _ in range(num_seqs)]
        for screen, llm in counting.items():
            CANDIDATES.clear()
            llm.generate(counted, params, use_tqdm=False)
            candidates[screen] = {
                "median": statistics.median(CANDIDATES) if CANDIDATES else None,
                "p90": float(np.percentile(CANDIDATES, 90)) if CANDIDATES else None,
                "max": max(CANDIDATES, default=None), "rows": len(CANDIDATES)}
        for round_ in range(rounds):
            prompts = [[int(t) for t in rng.integers(100, vocab - 100, 32)]
                       for _ in range(num_seqs)]
            answers = {}
            for name in rotated(list(engines), round_):
                started = time.perf_counter()
                outputs = engines[name].generate(prompts, params, use_tqdm=False)
                rates[name].append(num_seqs * tokens / (time.perf_counter() - started))
                answers[name] = [o.outputs[0].token_ids for o in outputs]
            same = same and all(answers[screen] == answers["plain"] for screen in screens)
        row = {"seqs": num_seqs, "same_tokens": same, "candidates": candidates,
               **{f"{name}_tok_s": statistics.median(r) for name, r in rates.items()},
               **{f"{name}_runs": r for name, r in rates.items()}}
        for a, b in ratios_for(precision):  # round by round: the same minutes of a drifting machine
            row[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
        rows.append(row)
        print(f"{Path(path).name} {num_seqs} seqs: "
              + ", ".join(f"{name} {row[name + '_tok_s']:.1f}" for name in engines)
              + " tok/s; " + ", ".join(f"{a}/{b} {row[f'{a}/{b}']:.2f}x"
                                       for a, b in ratios_for(precision)),
              flush=True)
    return {"model": path, "precision": precision, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="exported float32 models")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="the engines' compute dtype (bfloat16: the int8 screen only)")
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    screens, ratios = screens_for(args.precision), ratios_for(args.precision)

    results = [bench_model(m, args.seqs, args.rounds, args.tokens, args.precision)
               for m in args.models]
    machine = machine_info()
    table = make_table(f"greedy decode, {args.precision}, LM head screened in "
                       f"{' or '.join(screens)} or not (in-process)",
                       ("model", "seqs", "plain tok/s", *(f"{s} tok/s" for s in screens),
                        *(f"{a}/{b}" for a, b in ratios), "same tokens",
                        *(f"{screen} candidates / row (median, p90, max)" for screen in screens)),
                       caption=machine_summary(machine))

    def counts(c):
        return f"{c['median']:.0f}, {c['p90']:.0f}, {c['max']}" if c["rows"] else "-"

    for result in results:
        for r in result["rows"]:
            table.add_row(Path(result["model"]).name, str(r["seqs"]),
                          *(f"{r[name + '_tok_s']:.1f}" for name in ("plain", *screens)),
                          *(f"{r[f'{a}/{b}']:.2f}x" for a, b in ratios),
                          "yes" if r["same_tokens"] else "NO",
                          *(counts(r["candidates"][screen]) for screen in screens))
    make_console(80).print(table)
    path = write_json(result_path("screened-head", args.name),
                      {"machine": machine, "precision": args.precision, "rounds": args.rounds,
                       "tokens": args.tokens, "results": results}, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
