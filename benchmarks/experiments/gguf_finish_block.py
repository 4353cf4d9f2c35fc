#!/usr/bin/env python
"""The dense half of a one-row decode step on GGUF blocks: the separate ops (block matmul,
epilogue, norm, per projection, as the step composed them before) against the finish-block
op (kernels/gguf_finish_block.cc), alternating in one process.

SmolLM2-135M's shapes by default (30 layers, width 576, 9 + 2 x 3 heads of 64, MLP 1536,
SwiGLU, Q4_1 blocks of random weights): each call runs every layer's out, up and down and
the next layer's norm and QKV, 66 MB of blocks. The figure to read is the minimum over the
calls (and the ratio of minima): on a shared machine a call's time is mostly what other
processes leave it, and the minimum is the call that ran undisturbed. Medians are printed
too.

    PYTHONPATH=src python benchmarks/experiments/gguf_finish_block.py [--type q4_1]
        [--calls 40] [--rows 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="q4_1")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--qkv", type=int, default=960)
    parser.add_argument("--mlp", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--name", default="", help="suffix of the result file")
    args = parser.parse_args()

    import tensorflow as tf
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from common import machine_info, machine_summary, result_path, spread, write_json
    from tokenserve.kernels import dense as kdense
    from tokenserve.kernels.gguf_matmul import gguf_finish_block, gguf_matmul

    rng = np.random.default_rng(0)
    qtype = GGMLQuantizationType[args.type.upper()]

    def layer(n, k):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return {"parts": [(args.type, tf.constant(gguf_quants.quantize(w, qtype)))],
                "bias": None}

    d = args.width
    layers = [dict(out=layer(d, d), up=layer(2 * args.mlp, d), down=layer(d, args.mlp),
                   qkv=layer(args.qkv, d), norm={"scale": tf.ones([d])},
                   next_norm={"scale": tf.ones([d])}) for _ in range(args.layers)]
    x0 = tf.constant(rng.standard_normal((args.rows, d)).astype(np.float32))

    def linear(x, w, residual=None, activation="none"):
        z = gguf_matmul(x, w["parts"][0][1], args.type)
        return kdense.epilogue(z, None, residual, activation)

    @tf.function
    def separate(x):
        attn = x
        for w in layers:
            x1 = linear(attn, w["out"], residual=x)
            u = linear(kdense.layer_norm(x1, w["norm"]["scale"], None, 1e-5), w["up"],
                       activation="swiglu")
            x = linear(u, w["down"], residual=x1)
            qkv = linear(kdense.layer_norm(x, w["next_norm"]["scale"], None, 1e-5), w["qkv"])
            attn = qkv[:, :d] * 0.01 + x
        return x

    @tf.function
    def fused(x):
        attn = x
        for w in layers:
            x, qkv = gguf_finish_block(attn, x, w["out"], w["norm"], w["up"], w["down"],
                                       "swiglu", 1e-5, next_norm=w["next_norm"],
                                       next_qkv=w["qkv"])
            attn = qkv[:, :d] * 0.01 + x
        return x

    np.testing.assert_array_equal(separate(x0).numpy(), fused(x0).numpy())
    times = {"separate": [], "fused": []}
    for i in range(args.calls):
        for name, fn in (("separate", separate), ("fused", fused))[::1 if i % 2 else -1]:
            started = time.perf_counter()
            fn(x0).numpy()
            times[name].append((time.perf_counter() - started) * 1e3)
    info = machine_info()
    load = os.getloadavg()
    print(machine_summary(info), f"load average {load[0]:.1f}")
    nbytes = sum(int(np.prod(w[k]["parts"][0][1].shape)) for w in layers
                 for k in ("out", "up", "down", "qkv"))
    for name, values in times.items():
        print(f"{name:9s} min {min(values):7.2f} ms  median {np.median(values):7.2f} ms  "
              f"({nbytes / min(values) / 1e6:.1f} GB/s at the minimum)")
    ratio_min = min(times["separate"]) / min(times["fused"])
    ratio_median = np.median(times["separate"]) / np.median(times["fused"])
    print(f"separate / fused: {ratio_min:.2f}x at the minima, {ratio_median:.2f}x at the "
          f"medians")
    write_json(result_path("gguf-finish-block", args.name), {
        "machine": info, "load_average": load, "args": vars(args), "bytes": nbytes,
        "ms": {name: spread(values) | {"min": min(values)} for name, values in times.items()},
        "separate_over_fused": {"at_min": ratio_min, "at_median": ratio_median}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
