"""The LoRA block op against the plain block op, one layer, in one process, alternating.

The engine figures of benchmarks/lora.py swing with the machine's load; this measures the
part the adapters add to a decode step's layer, the fused block op (a block's second half
and the next block's QKV) with each row's LoRA deltas (TokenserveLoraFinishBlock) against
the same op without them (TokenserveFinishBlock), on GPT-2-small's and SmolLM2-135M's
shapes (float32, random weights), with the slot table's ranks (rank 16 per module: GPT-2 16
on every role; SmolLM2 48 on q/k/v, 32 on gate/up, 16 on o and down):

  base-32 / lora-32x4   32 rows, spread over 4 adapters (8 rows each)
  base-1  / lora-1      one row on one adapter

Each round times --calls back-to-back calls of each system, in rotated order; figures are
medians over rounds of the time per call. The machine is shared: compare within one run.

    python benchmarks/lora_block_op.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from common import (machine_summary, make_console, make_table, result_path, rotated, spread,
                    write_result)

SHAPES = {  # d, up width, activation, norm bias, qkv width, ranks by role
    "gpt2-small": (768, 3072, "gelu_tanh", True, 2304,
                   {"out": 16, "up": 16, "down": 16, "qkv": 16}),
    "smollm2": (576, 3072, "swiglu", False, 960, {"out": 16, "up": 32, "down": 16, "qkv": 48}),
}
SLOTS = 4


def make_inputs(model: str, rows: int, num_adapters: int, seed: int = 0) -> dict:
    import tensorflow as tf

    d, f, activation, norm_bias, nq, ranks = SHAPES[model]
    rng = np.random.default_rng(seed)
    inner = f // 2 if activation == "swiglu" else f

    def dense(k, n):
        w = {"kernel": tf.constant((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))}
        if norm_bias:
            w["bias"] = tf.constant(np.zeros(n, np.float32))
        return w

    def norm():
        w = {"scale": tf.constant(np.ones(d, np.float32))}
        if norm_bias:
            w["bias"] = tf.constant(np.zeros(d, np.float32))
        return w

    def factors(width_in, width_out, rank):  # 2 layers: the block's and the next one's
        return ([tf.constant(rng.standard_normal((2, width_in, rank)).astype(np.float32) * 0.01)
                 for _ in range(SLOTS)],
                [tf.constant(rng.standard_normal((2, rank, width_out)).astype(np.float32) * 0.01)
                 for _ in range(SLOTS)])

    row_slot = np.arange(rows) % num_adapters + 1  # slots 1..num_adapters, interleaved
    order = np.argsort(row_slot, kind="stable").astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(row_slot, minlength=SLOTS + 1))])
    return {"attn": tf.constant(rng.standard_normal((rows, d)).astype(np.float32)),
            "x": tf.constant(rng.standard_normal((rows, d)).astype(np.float32)),
            "out": dense(d, d), "norm": norm(), "up": dense(d, f), "down": dense(inner, d),
            "next_norm": norm(), "next_qkv": dense(d, nq), "activation": activation,
            "groups": (tf.constant(order), tf.constant(offsets.astype(np.int32))),
            "factors": {"out": factors(d, d, ranks["out"]), "up": factors(d, f, ranks["up"]),
                        "down": factors(inner, d, ranks["down"]),
                        "qkv": factors(d, nq, ranks["qkv"])}}


def systems(model: str) -> dict:
    """name -> a call of one layer's op, traced (as the step runs it: no eager dispatch of
    its inputs, which the LoRA op has 32 more of)."""
    import tensorflow as tf

    from tokenserve.kernels import dense as kd

    made = {}
    for rows, adapters, suffix in ((32, 4, "32x4"), (1, 1, "1")):
        i = make_inputs(model, rows, adapters)
        block = (i["attn"], i["x"], i["out"], i["norm"], i["up"], i["down"])
        following = dict(next_norm=i["next_norm"], next_qkv=i["next_qkv"])
        made[f"base-{rows}"] = (lambda block=block, i=i, following=following: kd.finish_block(
            *block, i["activation"], 1e-5, **following))
        made[f"lora-{suffix}"] = (lambda block=block, i=i, following=following:
                                  kd.lora_finish_block(*block, i["groups"], i["factors"], 0,
                                                       i["activation"], 1e-5, **following))
    return {name: tf.function(call, autograph=False) for name, call in made.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    console = make_console()
    report = {"workload": {"rounds": args.rounds, "calls": args.calls, "slots": SLOTS},
              "models": {}}
    for model in args.models:
        calls = systems(model)
        for call in calls.values():  # build and warm
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for round_index in range(args.rounds):
            for name in rotated(list(calls), round_index):
                started = time.perf_counter()
                for _ in range(args.calls):
                    calls[name]()
                times[name].append((time.perf_counter() - started) / args.calls * 1e6)
        median = {name: statistics.median(v) for name, v in times.items()}
        ratios = {"lora-32x4 / base-32": median["lora-32x4"] / median["base-32"],
                  "lora-1 / base-1": median["lora-1"] / median["base-1"]}
        report["models"][model] = {"us_per_call": {n: spread(v) for n, v in times.items()},
                                   "ratios": ratios}
        table = make_table(f"{model}: one layer's block op, us per call, median of "
                           f"{args.rounds}", ["system", "us", "min", "max"], left=("system",))
        for name, values in times.items():
            table.add_row(name, f"{median[name]:.0f}", f"{min(values):.0f}",
                          f"{max(values):.0f}")
        console.print(table)
        for name, ratio in ratios.items():
            console.print(f"  {name}: {ratio:.2f}x the time")
    path = result_path("lora-block-op")
    info = write_result(path, **report)
    console.print(f"{machine_summary(info)}; noisy shared machine: compare within this run. "
                  f"Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
