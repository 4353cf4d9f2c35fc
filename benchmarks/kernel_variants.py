#!/usr/bin/env python
"""Whether a prebuilt ISA variant of the ops runs at the speed of a build for this very CPU.

An image carries the op libraries prebuilt for a few ISA levels (`python -m
tokenserve.kernels.build --all-variants`) and each CPU loads the best one it runs. This
measures, each in its own process (a process loads one build of a library):
  native        the ops built here with -march=native (TOKENSERVE_KERNELS_MARCH=native): the
                baseline, what a machine with g++ builds for itself
  <variant>     each prebuilt variant this CPU runs (TOKENSERVE_KERNELS_ISA=<variant>)
the median time of the int8 matmul op and the GGUF Q4_1 block op (SmolLM2's block type) on
GPT-2-small and SmolLM2 shapes at M = 1 (one decode stream) and 32 (32 streams), weights
read from memory (each call cycles through more than 48 MB of copies, beyond L3), and each
variant's ratio to native. The configurations take turns over --rounds rounds (the order
rotates), so a slow minute of a shared machine falls on each.

Output: a table and benchmarks/results/kernel_variants[-NAME].json.

Run:  python benchmarks/kernel_variants.py [--rounds 3] [--reps 5] [--name epyc-avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from common import (machine_summary, make_console, make_table, result_path,  # noqa: E402
                    rotated, run_child, write_json, write_result)

# (K inputs, N outputs, op): GPT-2-small's MLP up as int8, SmolLM2's MLP gate and down as Q4_1
CASES = [(768, 3072, "int8"), (576, 1536, "q4_1"), (1536, 576, "q4_1")]
BATCHES = [1, 32]
WORKING_SET = 48e6  # weight bytes cycled through per call: more than a 32 MB L3
LIBRARIES = ("int8_matmul", "gguf_matmul")


def measure(reps: int) -> dict:
    """In the configured process: {case: median ms per matmul}, and each library's status."""
    import numpy as np
    import tensorflow as tf
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from tokenserve.kernels import gguf_matmul as gm
    from tokenserve.kernels import int8_matmul as im

    tf.get_logger().setLevel("ERROR")
    rng = np.random.default_rng(0)
    ms = {}
    for k, n, op in CASES:
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)  # [N, K]
        if op == "int8":
            arrays = im.quantize_weight(w.T)
            fn = im.int8_matmul
        else:
            arrays = (gguf_quants.quantize(w, GGMLQuantizationType[op.upper()]),)
            fn = lambda x, blocks, op=op: gm.gguf_matmul(x, blocks, op)  # noqa: E731
        copies = max(1, int(np.ceil(WORKING_SET / arrays[0].nbytes)))
        weights = [[tf.constant(a) for a in arrays] for _ in range(copies)]
        for m in BATCHES:
            x0 = tf.constant(rng.standard_normal((m, k)).astype(np.float32))

            def chain(x, fn=fn, weights=weights):
                for ws in weights:
                    x = x + fn(x, *ws)[:, :1] * 1e-30  # the next matmul depends on this one
                return x

            step = tf.function(chain)
            step(x0).numpy()
            step(x0).numpy()  # warm up: trace, fault the weights in
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step(x0).numpy()
                times.append((time.perf_counter() - start) / copies)
            ms[f"{op} {k}x{n} M={m}"] = statistics.median(times) * 1e3
    return ms


def child(reps: int, output: Path) -> None:
    from tokenserve.kernels.build import LIBRARIES as ALL

    statuses = {name: ALL[name].status() for name in LIBRARIES}
    for name, status in statuses.items():
        if not status.startswith("compiled"):
            raise SystemExit(f"{name} is not compiled here: {status}")
    write_json(output, {"statuses": statuses, "loadavg": os.getloadavg()[0],
                        "ms": measure(reps)})


def configs(prebuilt: Path) -> dict[str, dict[str, str]]:
    """native plus every variant this CPU runs, each with the environment that picks it."""
    from tokenserve.host.cpu_flags import cpu_flag_set
    from tokenserve.kernels.prebuilt import PREBUILT_ENV
    from tokenserve.kernels.variants import ISA_ENV, supported_variants

    out = {"native": {"TOKENSERVE_KERNELS_MARCH": "native"}}
    for variant in supported_variants(cpu_flag_set()):
        out[variant.name] = {ISA_ENV: variant.name, PREBUILT_ENV: str(prebuilt)}
    return out


def build_variants(prebuilt: Path) -> float:
    """Builds the measured libraries (and the runtime) as each variant this CPU runs into
    `prebuilt`, where the children find them; returns the seconds it took."""
    from tokenserve.host.cpu_flags import cpu_flag_set
    from tokenserve.kernels.all_variants import build_all_variants, format_builds
    from tokenserve.kernels.build import LIBRARIES as ALL
    from tokenserve.kernels.build import RUNTIME_SOURCE
    from tokenserve.kernels.variants import supported_variants

    start = time.perf_counter()
    builds = build_all_variants({"helpers": [RUNTIME_SOURCE],
                                 **{name: ALL[name].sources for name in LIBRARIES}},
                                supported_variants(cpu_flag_set()), prebuilt)
    print(format_builds(builds), file=sys.stderr)
    if not all(build.path for build in builds):
        raise SystemExit("a variant failed to build")
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--name", default="", help="suffix of the result file")
    parser.add_argument("--prebuilt", type=Path, default=None,
                        help="where the variants are built and loaded from (default: a folder "
                             "of the user cache that serving does not search)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.reps, args.child_output)
        return 0

    from tokenserve.host.user_cache import cache_dir

    prebuilt = args.prebuilt or cache_dir("kernel-variant-bench")
    build_seconds = build_variants(prebuilt)
    chosen = configs(prebuilt)
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for r in range(args.rounds):
        for name in rotated(list(chosen), r):
            print(f"round {r + 1}: {name}", file=sys.stderr)
            runs[name].append(run_child(["--child", "--reps", str(args.reps)], chosen[name]))
    cases = list(runs["native"][0]["ms"])
    medians = {name: {case: statistics.median(run["ms"][case] for run in results)
                      for case in cases} for name, results in runs.items()}
    info = write_result(result_path("kernel_variants", args.name), configs=chosen,
                        build_seconds=build_seconds, rounds=args.rounds, reps=args.reps,
                        statuses={name: results[0]["statuses"] for name, results in runs.items()},
                        loadavg={name: [run["loadavg"] for run in results]
                                 for name, results in runs.items()},
                        median_ms=medians,
                        per_round_ms={name: [run["ms"] for run in results]
                                      for name, results in runs.items()})
    console = make_console(160)
    console.print(machine_summary(info), markup=False)
    variants = [name for name in chosen if name != "native"]
    out = make_table(f"median ms per matmul over {args.rounds} rounds (weights from memory; "
                     "a shared, noisy machine), and each build's ratio to native",
                     ["case", *chosen, *[f"{name} / native" for name in variants]],
                     left=("case",))
    for case in cases:
        out.add_row(case, *[f"{medians[name][case]:.3f}" for name in chosen],
                    *[f"{medians[name][case] / medians['native'][case]:.2f}" for name in variants])
    console.print(out)
    for name, results in runs.items():
        console.print(f"{name}: {results[0]['statuses']['int8_matmul']}", markup=False)
    console.print(f"built {len(LIBRARIES) + 1} libraries x each variant in {build_seconds:.0f} s"
                  " (about 0 when already built)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
