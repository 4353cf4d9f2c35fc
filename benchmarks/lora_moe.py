#!/usr/bin/env python
"""LoRA adapters on a mixture of experts: the step cost of adapters of the attention, and of
adapters of the experts, shared expert and router, against the base, in one run.

One random Qwen2-MoE-shaped model (float32, the built-in tokenizer's vocabulary, --experts
experts top --top-k, each --expert-width wide, a shared expert as wide), engines with 4
adapter slots; rank-16 PEFT adapters written here (random factors): two on q/k/v/o_proj
only, two on those plus the router and the shared expert's gate/up/down_proj and gate, two
on all of that plus the stacked experts (gate_up_proj, down_proj). Systems, each a batch
of random 32-token prompts decoding --new-tokens greedy tokens:

  base-N       N streams on the base model (the grouped experts' one op a layer)
  attn-N       N streams spread over the two attention adapters (the same op: their
               deltas sit on the attention projections)
  around-N     N streams over two adapters of the attention, router and shared expert
               (the grouped experts' op on the adapted routing; the shared expert and
               router deltas in TF ops)
  experts-N    N streams spread over the two expert adapters (each MoE layer as stock TF
               ops with each (row, expert) pair's delta: engine/step/lora_moe.py)

for N = 1 and 8, each system on its own engine (the same random weights), the three
engines taking one step each in turn, so each sees the same load at the same moments; the
median full-batch decode step of each, medians over rounds (the turn order rotates), and
the ratios to base in the same round. The machine is shared and noisy: compare only within
one run.

    python benchmarks/lora_moe.py                          # hidden 512, 4 layers, 3 rounds
    python benchmarks/lora_moe.py --rounds 1 --new-tokens 8   # a quick look

Writes benchmarks/results/lora_moe.json (or --output).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import finish_rounds, make_console, make_table, result_path, rotated, spread
from moe import add_shape_arguments

console = make_console(140)
RANK = 16
STREAMS = (1, 8)


def architecture(args):
    from tokenserve.config import llama_config

    dense = llama_config(vocab_size=8192, max_seq_len=512, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.hidden // 64,
                         num_kv_heads=max(1, args.hidden // 256),
                         intermediate_size=args.expert_width)
    return dataclasses.replace(dense, num_experts=args.experts, num_experts_per_token=args.top_k,
                               shared_expert_size=args.expert_width)


def write_adapter(directory: Path, config, kind: str, seed: int) -> Path:
    """A rank-16 PEFT adapter in transformers 5's names (random A, small random B) of the
    attention ("attn"), plus the router and shared expert ("around"), plus the experts
    ("experts")."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d, e, f = config.hidden_size, config.num_experts, config.expert_intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    modules = {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv),
               "self_attn.v_proj": (d, kv), "self_attn.o_proj": (q, d)}
    if kind != "attn":
        fs = config.shared_expert_size
        modules.update({"mlp.gate": (d, e), "mlp.shared_expert.gate_proj": (d, fs),
                        "mlp.shared_expert.up_proj": (d, fs),
                        "mlp.shared_expert.down_proj": (fs, d), "mlp.shared_expert_gate": (d, 1)})
    if kind == "experts":
        modules.update({"mlp.experts.base_layer": (d, 2 * f, e), "mlp.experts": (f, d, e)})
    tensors = {}
    for layer in range(config.num_layers):
        for module, (width_in, width_out, *count) in modules.items():
            n = count[0] if count else 1
            name = f"base_model.model.model.layers.{layer}.{module}.lora_"
            tensors[name + "A.weight"] = rng.uniform(-0.05, 0.05, [n * RANK, width_in]).astype(
                np.float32)
            tensors[name + "B.weight"] = rng.normal(0, 0.01, [width_out, n * RANK]).astype(
                np.float32)
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(
        f'{{"peft_type": "LORA", "r": {RANK}, "lora_alpha": {2 * RANK}}}')
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def build_engine(config):
    from tokenserve.config import GenerationConfig
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.model import build_model
    from tokenserve.model.checkpoint import BUILTIN_DIR
    from tokenserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    generation = GenerationConfig(model=config, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, name="bench")
    knobs = EngineConfig(max_num_seqs=max(STREAMS), max_num_batched_tokens=512,
                         precision="float32", max_cache_tokens=max(STREAMS) * 160,
                         max_loras=4, max_lora_rank=RANK)
    return LLMEngine(ModelRunner(build_model(config, seed=0), generation, knobs), tokenizer,
                     knobs)


def start(engine, loras: list, num_streams: int, new_tokens: int, seed: int) -> list:
    """Queues `num_streams` random 32-token prompts, stream i on loras[i % len(loras)]
    (None: the base); returns the requests."""
    from tokenserve.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [engine.make_request([int(t) for t in rng.integers(3, 8192, 32)], params,
                                    lora=loras[i % len(loras)]) for i in range(num_streams)]
    for request in requests:
        engine.add_request(request)
    return requests


def run_interleaved(engines: dict, loras: dict, num_streams: int, new_tokens: int,
                    seed: int) -> dict[str, float]:
    """Each system's median full-batch decode step (ms), the systems' engines stepping in
    turn (one step each), so each sees the same load at the same moments."""
    requests = {name: start(engines[name], loras[name], num_streams, new_tokens, seed)
                for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    while any(engine.has_work for engine in engines.values()):
        for name, engine in engines.items():
            if not engine.has_work:
                continue
            decoding = sum(len(r.seqs[0].output_ids) > 0 for r in requests[name])
            before = time.perf_counter()
            engine.step()
            if decoding == num_streams:
                steps[name].append(time.perf_counter() - before)
    return {name: 1e3 * statistics.median(times) for name, times in steps.items()}


def main() -> None:
    from tokenserve.engine.lora_adapter import LoraRequest

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, hidden=512, expert_width=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=result_path("lora_moe"))
    args = parser.parse_args()

    config = architecture(args)
    load_before = os.getloadavg()
    # one engine per system (the same random weights), stepped in turn
    engines = {name: build_engine(config) for name in ("base", "attn", "around", "experts")}
    table_mib = engines["base"].runner.step.lora_table.num_bytes / 2**20
    experts_mib = engines["base"].runner.step.lora_table.moe.num_bytes / 2**20
    root = Path(tempfile.mkdtemp(prefix="lora_moe_"))
    loras = {"base": [None]}
    for j, kind in enumerate(("attn", "around", "experts")):
        loras[kind] = [LoraRequest.new(f"{kind}{i}", write_adapter(
            root / f"{kind}{i}", config, kind, seed=10 * i + j)) for i in range(2)]
    for n in STREAMS:  # warm-up: every trace the timed runs take
        run_interleaved(engines, loras, n, 4, seed=0)
    results = {f"{name}-{n}": [] for name in engines for n in STREAMS}
    for r in range(args.rounds):
        order = dict(rotated(list(engines.items()), r))
        for n in STREAMS:
            for name, ms in run_interleaved(order, loras, n, args.new_tokens,
                                            seed=100 + r).items():
                results[f"{name}-{n}"].append(ms)
        console.print(f"round {r + 1}/{args.rounds} done")
    ratios = {f"{name}_{n}_step_over_base": spread(
        [x / y for x, y in zip(results[f"{name}-{n}"], results[f"base-{n}"])])
        for name in ("attn", "around", "experts") for n in STREAMS}
    table = make_table(
        f"LoRA on a MoE ({args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"top-{args.top_k}, rank {RANK}; slot table {table_mib:.1f} MiB, of which "
        f"{experts_mib:.1f} MiB MoE factors; float32, in-process engine, medians over rounds)",
        ["system", "decode step ms", "x base (same round)"], left=["system"])
    for key, values in results.items():
        name, n = key.rsplit("-", 1)
        ratio = "" if name == "base" else f"{ratios[f'{name}_{n}_step_over_base']['median']:.2f}"
        table.add_row(key, f"{statistics.median(values):.2f}", ratio)
    console.print(table)
    finish_rounds(console, args, ratios, load_before, results=results,
                  slot_table_mib=table_mib, moe_factors_mib=experts_mib)


if __name__ == "__main__":
    main()
