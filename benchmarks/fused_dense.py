"""Where the fused dense ops stop beating XLA: engine steps at each `max_fused_dense_tokens`.

A float32 step of at most `max_fused_dense_tokens` tokens runs the dense half through the
fused custom ops (kernels/dense.cc), a larger one through XLA's programs. Where they cross
depends on the CPU (XLA's dots use AVX-512 where there is one; the ops are AVX2), so this
measures both sides on the machine at hand:

    python benchmarks/fused_dense.py /tmp/headline/gpt2-float32 --settings 4 32

For each setting, one engine (one process, all built first and warmed up) runs
  decode   S sequences decoding together (`--seqs`), the median step that decodes exactly S
           and prefills nothing;
  prefill  one prompt of T tokens (`--prompts`), the step that prefills it;
in `--rounds` rounds alternating between the settings (this VM's speed drifts by 15-40 %
between minutes). A step's time is the engine's own measure (its StepStats: the model call,
not the Python around it). Prints a table of medians and writes
benchmarks/results/fused-dense[-NAME].json with the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from common import make_console, make_table, machine_summary, result_path, write_result
from step_times import StepTimes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a float32 export (base path or version dir)")
    parser.add_argument("--settings", type=int, nargs="+", default=[4, 32],
                        help="max_fused_dense_tokens values to compare (0: XLA only)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    import numpy as np
    from tqdm import tqdm

    from tokenserve import LLM
    from tokenserve.engine.config import EngineConfig
    from tokenserve.sampling import SamplingParams

    max_seqs = max(args.seqs)
    engines = {}
    for setting in tqdm(args.settings, desc="load and compile", unit="engine"):
        config = EngineConfig(precision="float32", max_num_seqs=max_seqs,
                              max_fused_dense_tokens=setting, enable_prefix_caching=False)
        llm = LLM(args.model, config)
        llm.engine.runner.compile_buckets()
        engines[setting] = llm
    vocab = next(iter(engines.values())).engine.config.model.vocab_size
    rng = np.random.default_rng(0)
    # (kind, size, prompts, params, which steps count)
    cases = [("decode", s, [rng.integers(10, vocab, 16).tolist() for _ in range(s)],
              SamplingParams(max_tokens=args.new_tokens, ignore_eos=True), (s, 0))
             for s in args.seqs]
    cases += [("prefill", t, [rng.integers(10, vocab, t).tolist()],
               SamplingParams(max_tokens=1, ignore_eos=True), (0, t)) for t in args.prompts]
    for llm in engines.values():  # warm-up: traces every step graph the cases use
        for *_, prompts, params, _ in cases:
            llm.generate(prompts, params, use_tqdm=False)
    times = {(setting, kind, size): [] for setting in engines for kind, size, *_ in cases}
    work = [(r, case, setting) for r in range(args.rounds) for case in cases
            for setting in engines]
    for _, (kind, size, prompts, params, counted), setting in tqdm(work, desc="rounds",
                                                                   unit="run"):
        llm = engines[setting]
        for _ in range(3 if kind == "prefill" else 1):  # a prefill is one step: take three
            sink = StepTimes()
            llm.engine.stats = sink
            llm.generate(prompts, params, use_tqdm=False)
            times[setting, kind, size] += sink.durations(*counted)

    results = []
    for kind, size, *_ in cases:
        row = {"kind": kind, "size": size, "step_ms_median": {}, "steps": {}}
        for setting in engines:
            durations = times[setting, kind, size]
            row["steps"][setting] = len(durations)
            row["step_ms_median"][setting] = (1e3 * statistics.median(durations)
                                              if durations else None)
        results.append(row)

    table = make_table("engine step (ms, median) by max_fused_dense_tokens, float32",
                       ["step", *(f"fused <= {setting}" if setting else "XLA only"
                                  for setting in engines)], left=("step",))
    first = args.settings[0]
    for row in results:
        label = (f"decode {row['size']} seqs" if row["kind"] == "decode"
                 else f"prefill {row['size']} tokens")
        cells = []
        for setting in engines:
            median = row["step_ms_median"][setting]
            ratio = (median / row["step_ms_median"][first]
                     if median and row["step_ms_median"][first] else None)
            cells.append("-" if median is None else
                         f"{median:.1f}" + (f" ({ratio:.2f}x)" if setting != first else ""))
        table.add_row(label, *cells)
    console = make_console(80)
    console.print(table)
    out = result_path("fused-dense", args.name)
    info = write_result(out, rounds=args.rounds, new_tokens=args.new_tokens, results=results)
    console.print(machine_summary(info))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
