#!/usr/bin/env python
"""A mixture of experts against dense models of the same hidden size, in one run.

Three random models (float32, the built-in tokenizer's 8,192-token vocabulary) share
everything but the MLP:

  moe          Qwen3-MoE-shaped: --experts experts (default 8), top --top-k (2), each a
               SwiGLU MLP --expert-width wide (2,048), router renormalised; each layer's
               router and experts one op (kernels/moe_layer.cc)
  dense-all    one dense SwiGLU MLP as wide as all experts together (experts x width)
  dense-active one dense SwiGLU MLP as wide as the active experts only (top-k x width)

Each round runs every model in the engine in process (LLMEngine, no server), in an order
that rotates by round, so a slow minute of this shared machine falls on all of them:

  1 stream     one random 32-token prompt, --new-tokens greedy tokens: the median decode
               step (engine.step(), schedule to update)
  32 streams   32 such prompts at once: generated tokens over the whole run's wall time
               (prefill included), and the median full-batch decode step

and reports the ratios the target names (MoE 1-stream step / dense-active's and /
dense-all's; MoE 32-stream tok/s / dense-active's), medians over rounds with their spread.
The MoE's expert load comes from the engine's own step stats (StepStats.expert_tokens): the
experts with rows per layer per decode step at 1 and 32 streams, hence the share of the
expert bytes a step reads.

    python benchmarks/moe.py                       # hidden 1024, 8 layers, 8 experts, 3 rounds
    python benchmarks/moe.py --rounds 1 --layers 2 --new-tokens 16   # a quick look

Writes benchmarks/results/moe.json (or --output).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import numpy as np

from common import finish_rounds, make_console, make_table, result_path, rotated, spread
from tokenserve.stats import StatsSink

console = make_console(140)


def architectures(args) -> dict:
    from tokenserve.config import llama_config

    def dense(width: int):
        return llama_config(vocab_size=8192, max_seq_len=512, hidden_size=args.hidden,
                            num_layers=args.layers, num_heads=args.hidden // 64,
                            num_kv_heads=max(1, args.hidden // 256), intermediate_size=width)
    moe = dataclasses.replace(dense(args.expert_width), num_experts=args.experts,
                              num_experts_per_token=args.top_k)
    return {"moe": moe, "dense-all": dense(args.experts * args.expert_width),
            "dense-active": dense(args.top_k * args.expert_width)}


class LoadSink(StatsSink):
    """Keeps each step's batch size and expert load."""

    def __init__(self):
        self.steps: list[tuple[int, tuple]] = []

    def on_step(self, stats):
        self.steps.append((stats.num_decode_tokens, stats.expert_tokens))


def build_engine(architecture, seed: int):
    from tokenserve.config import GenerationConfig
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.model import build_model
    from tokenserve.model.checkpoint import BUILTIN_DIR
    from tokenserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="bench")
    knobs = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, precision="float32",
                         max_cache_tokens=32 * 160)
    engine = LLMEngine(ModelRunner(build_model(architecture, seed=seed), config, knobs),
                       tokenizer, knobs)
    engine.stats = LoadSink()
    return engine


def run(engine, num_streams: int, new_tokens: int, seed: int) -> dict:
    """One batch of `num_streams` random 32-token prompts: tok/s over the whole run and the
    median step time of full-batch decode steps."""
    from tokenserve.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for _ in range(num_streams):
        engine.add_request(engine.make_request([int(t) for t in rng.integers(3, 8192, 32)],
                                               params))
    engine.stats.steps.clear()
    steps, started = [], time.perf_counter()
    while engine.has_work:
        before = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - before)
    wall = time.perf_counter() - started
    full = [t for t, (decode, _) in zip(steps, engine.stats.steps) if decode == num_streams]
    loads = [np.asarray(load) for decode, load in engine.stats.steps
             if decode == num_streams and load]
    return {"tok_s": num_streams * new_tokens / wall,
            "decode_step_ms": 1e3 * statistics.median(full),
            # experts with rows per layer per full-batch decode step (mean over layers/steps)
            "active_experts": float(np.mean([(l > 0).sum(1).mean() for l in loads]))
            if loads else None}


def add_shape_arguments(parser, hidden: int = 1024, expert_width: int = 2048) -> None:
    """--hidden, --experts, --top-k, --expert-width: the MoE's shape, as this benchmark,
    moe_op.py (one layer's op) and lora_moe.py (adapters, a smaller default) take it."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=expert_width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=result_path("moe"))
    args = parser.parse_args()

    archs = architectures(args)
    load_before = os.getloadavg()
    engines = {name: build_engine(arch, seed=i) for i, (name, arch) in enumerate(archs.items())}
    for name, engine in engines.items():  # warm-up: every shape the timed runs take
        run(engine, 1, 8, seed=0)
        run(engine, 32, 8, seed=0)
        console.print(f"warmed up {name}")
    results = {name: {"1": [], "32": []} for name in engines}
    for r in range(args.rounds):
        for name in rotated(list(engines), r):
            for streams in (1, 32):
                results[name][str(streams)].append(
                    run(engines[name], streams, args.new_tokens, seed=100 + r))
        console.print(f"round {r + 1}/{args.rounds} done")

    def med(name, streams, key):
        return statistics.median(x[key] for x in results[name][streams])

    def ratio(a, b, streams, key):
        return spread([x[key] / y[key] for x, y in zip(results[a][streams],
                                                         results[b][streams])])

    ratios = {
        "one_stream_step_moe_over_active": ratio("moe", "dense-active", "1", "decode_step_ms"),
        "one_stream_step_moe_over_all": ratio("moe", "dense-all", "1", "decode_step_ms"),
        "streams32_tok_s_moe_over_active": ratio("moe", "dense-active", "32", "tok_s"),
        "streams32_step_moe_over_active": ratio("moe", "dense-active", "32", "decode_step_ms"),
    }
    table = make_table("MoE vs dense (float32, in-process engine, medians over rounds)",
                       ["model", "MLP params/layer (M)", "1-stream step ms", "32-stream tok/s",
                        "32-stream step ms", "experts with rows/layer (1 / 32 streams)"],
                       left=["model"])
    d = args.hidden
    for name, arch in archs.items():
        width = (arch.num_experts or 1) * (arch.expert_intermediate_size or
                                           arch.intermediate_size)
        active = "" if not arch.num_experts else (
            f"{med(name, '1', 'active_experts'):.2f} / "
            f"{med(name, '32', 'active_experts'):.2f} of {arch.num_experts}")
        table.add_row(name, f"{3 * d * width / 1e6:.1f}", f"{med(name, '1', 'decode_step_ms'):.2f}",
                      f"{med(name, '32', 'tok_s'):.1f}", f"{med(name, '32', 'decode_step_ms'):.1f}",
                      active)
    console.print(table)
    finish_rounds(console, args, ratios, load_before, results=results)


if __name__ == "__main__":
    main()
