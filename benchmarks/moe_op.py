#!/usr/bin/env python
"""One mixture-of-experts layer op against the same op on the active experts only, and the
bytes of expert weights each call reads (float32 and GGUF Q4_0 experts).

Where benchmarks/moe.py times whole engine steps, this times one layer's op alone (eagerly,
the op's own time plus TF's eager dispatch), so the cost of routing and of running top-k
experts instead of one wide MLP shows without the rest of the step:

  moe           --experts experts (8) of --expert-width (2,048), top --top-k (2), router
                included (kernels/moe_layer.cc; moe_gguf_layer.cc for the Q4_0 blocks)
  given         the same experts, the router's choice given as inputs (moe_experts.cc):
                the router's share is moe - given (float32 only)
  active-only   one expert top-k x width wide that every row takes (the same op, E = k = 1):
                what an active-only dense MLP reads and computes, through the same kernels

at 1 row (one decode stream) and 32 rows (32 streams), in rounds whose order rotates. Bytes
read: the weights of every expert with rows in the call (each read once for all its rows),
against the active-only MLP's.

    python benchmarks/moe_op.py                    # hidden 1024, 8 experts of 2048, 5 rounds
    python benchmarks/moe_op.py --rounds 2 --calls 10   # a quick look

Writes benchmarks/results/moe_op.json (or --output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from common import finish_rounds, make_console, make_table, result_path, rotated, spread
from moe import add_shape_arguments

console = make_console(140)


def tensor(value, dtype=np.float32):
    """A tf constant made once: the timed calls must not copy weights from NumPy."""
    import tensorflow as tf

    return tf.constant(np.asarray(value, dtype))


def float_variants(rng, args) -> dict:
    """name -> (call(x) -> counts or None, expert bytes read given counts)."""
    from tokenserve.kernels import moe as kmoe

    d, f, e, k = args.hidden, args.expert_width, args.experts, args.top_k
    ups = [tensor(rng.normal(0, 0.02, [d, 2 * f])) for _ in range(e)]
    downs = [tensor(rng.normal(0, 0.02, [f, d])) for _ in range(e)]
    router = tensor(rng.normal(0, 0.05, [d, e]))
    no_router = tensor(np.zeros([d, 1]))
    wide_up = tensor(rng.normal(0, 0.02, [d, 2 * k * f]))
    wide_down = tensor(rng.normal(0, 0.02, [k * f, d]))
    expert_bytes = 3 * d * f * 4

    def moe(x):
        return kmoe.moe_layer(x, router, ups, downs, k, True)[1]

    def given(x):
        ids, gates = choices[len(x)]
        return kmoe.moe_experts(x, ids, gates, ups, downs, with_counts=True)[1]

    def active(x):
        kmoe.moe_layer(x, no_router, [wide_up], [wide_down], 1, True)
        return None

    choices = {rows: (tensor(np.stack([rng.choice(e, k, replace=False) for _ in range(rows)]),
                             np.int32), tensor(np.full([rows, k], 1.0 / k)))
               for rows in (1, 32)}

    return {"moe f32": (moe, expert_bytes), "given f32": (given, expert_bytes),
            "active-only f32": (active, k * expert_bytes)}


def gguf_variants(rng, args) -> dict:
    import gguf

    from tokenserve.kernels import moe as kmoe

    d, f, e, k = args.hidden, args.expert_width, args.experts, args.top_k
    q4 = gguf.GGMLQuantizationType.Q4_0

    def blocks(rows, cols):
        return tensor(gguf.quants.quantize(rng.normal(0, 0.02, [rows, cols]).astype(np.float32),
                                           q4), np.uint8)

    experts = [(("q4_0", blocks(f, d)), ("q4_0", blocks(f, d)), ("q4_0", blocks(d, f)))
               for _ in range(e)]
    wide = [(("q4_0", blocks(k * f, d)), ("q4_0", blocks(k * f, d)), ("q4_0", blocks(d, k * f)))]
    router = tensor(rng.normal(0, 0.05, [d, e]))
    no_router = tensor(np.zeros([d, 1]))
    expert_bytes = sum(int(np.prod(b.shape)) for _, b in experts[0])

    def moe(x):
        return kmoe.moe_gguf_layer(x, router, experts, k, True)[1]

    def active(x):
        kmoe.moe_gguf_layer(x, no_router, wide, 1, True)
        return None

    return {"moe q4_0": (moe, expert_bytes), "active-only q4_0": (active, k * expert_bytes)}


def time_calls(call, x, calls: int) -> tuple[float, float]:
    """(median ms a call, median expert bytes read a call; active-only: all of its weights)."""
    times, experts_read = [], []
    for _ in range(calls):
        started = time.perf_counter()
        counts = call(x)
        times.append(time.perf_counter() - started)
        if counts is not None:
            experts_read.append(int((np.asarray(counts) > 0).sum()))
    return 1e3 * statistics.median(times), (statistics.median(experts_read)
                                            if experts_read else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--output", type=Path, default=result_path("moe_op"))
    args = parser.parse_args()

    from tokenserve.kernels import moe as kmoe

    if not kmoe.is_compiled():
        raise SystemExit(f"the MoE op is not compiled here: {kmoe.kernel_status()}")
    rng = np.random.default_rng(0)
    variants = float_variants(rng, args) | gguf_variants(rng, args)
    inputs = {rows: tensor(rng.normal(0, 1, [rows, args.hidden])) for rows in (1, 32)}
    load_before = os.getloadavg()
    for call, _ in variants.values():  # warm-up: kernels loaded, buffers touched
        for x in inputs.values():
            call(x)
    results = {name: {str(rows): [] for rows in inputs} for name in variants}
    for r in range(args.rounds):
        for name in rotated(list(variants), r):
            for rows, x in inputs.items():
                ms, read = time_calls(variants[name][0], x, args.calls)
                results[name][str(rows)].append({"ms": ms, "experts_read": read})
        console.print(f"round {r + 1}/{args.rounds} done")

    def ratio(a, b, rows):
        return spread([x["ms"] / y["ms"] for x, y in zip(results[a][rows], results[b][rows])])

    table = make_table("One MoE layer op vs the active experts only (medians over rounds)",
                       ["variant", "1 row ms", "32 rows ms", "experts read (1 / 32 rows)",
                        "expert MB read (1 / 32 rows)"], left=["variant"])
    report = {}
    for name, (_, expert_bytes) in variants.items():
        row = {}
        for rows in ("1", "32"):
            ms = statistics.median(x["ms"] for x in results[name][rows])
            read = [x["experts_read"] for x in results[name][rows] if x["experts_read"]]
            mb = (statistics.median(read) if read else 1) * expert_bytes / 1e6
            row[rows] = {"ms": ms, "expert_mb": mb,
                         "experts_read": statistics.median(read) if read else None}
        report[name] = row
        experts = " / ".join("-" if row[r]["experts_read"] is None
                             else f"{row[r]['experts_read']:.0f}" for r in ("1", "32"))
        table.add_row(name, f"{row['1']['ms']:.3f}", f"{row['32']['ms']:.3f}", experts,
                      f"{row['1']['expert_mb']:.1f} / {row['32']['expert_mb']:.1f}")
    console.print(table)
    ratios = {f"{kind}_{rows}row_moe_over_active": ratio(f"moe {kind}", f"active-only {kind}",
                                                          rows)
              for kind in ("f32", "q4_0") for rows in ("1", "32")}
    ratios["f32_1row_given_over_moe"] = ratio("given f32", "moe f32", "1")
    finish_rounds(console, args, ratios, load_before, results=results, summary=report)


if __name__ == "__main__":
    main()
