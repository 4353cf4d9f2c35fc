"""LoRA adapters' cost in the engine's step, and their live load, in one run per model.

Systems, each on the same model in the same process (in-process `LLMEngine`, greedy, every
request 32 random prompt tokens and --max_tokens new ones):

  base-32     32 streams on the base model
  lora-32x4   32 streams spread over 4 different rank-16 adapters (all 7 modules), in the
              same steps: the target is >= 0.85x base-32's aggregate tok/s
  base-1      one stream on the base model
  lora-1      one stream on an adapter: the target is >= 0.9x base-1
  merged-1    one stream on a model with that adapter merged into its weights: the ceiling
              (merging cannot serve 32 streams of 4 adapters at once)

Then the live load: the time to check a rank-16 adapter (read, parse, fuse: the load
endpoint's part, off the engine's thread); and, with 4 streams decoding on the base, the
step in which a base request arrives against the step in which a request on an adapter not
yet in a slot arrives (its prefill and its slot write): the streams' gap is that step,
against their median step (the target: a load under 1 s, no gap above 2x the median
inter-token latency).

Rounds alternate the systems' order; figures are medians over rounds. The machine is shared
and noisy: compare only within one run.

    python benchmarks/lora.py                        # gpt2-small (random) and smollm2
    python benchmarks/lora.py --models gpt2-small --rounds 1 --max_tokens 16   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (machine_summary, make_console, make_table, result_path,  # noqa: E402
                    rotated, spread, write_result)

SYSTEMS = ("base-32", "lora-32x4", "base-1", "lora-1", "merged-1")
RANK = 16
PROMPT_LEN = 32


def make_adapters(model, directory: Path, count: int) -> list[Path]:
    """`count` random rank-16 PEFT adapters on every module (B small and nonzero)."""
    from tokenserve.train.lora import LoraModel

    paths = []
    for i in range(count):
        lora = LoraModel(model, RANK, seed=i)
        rng = np.random.default_rng(100 + i)
        for _, b in lora.factors.values():
            b.assign(rng.normal(0, 0.01, b.shape).astype(np.float32))
        paths.append(lora.save_adapter(directory / f"adapter-{i}"))
    return paths


def build_engine(model, tokenizer, config, max_loras: int):
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner

    # a KV pool for 32 streams of this workload, not the whole context: two engines of
    # SmolLM2 with default pools were killed for memory on a 24 GiB VM
    engine_config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                                 max_cache_tokens=8192, max_loras=max_loras,
                                 max_lora_rank=RANK)
    return LLMEngine(ModelRunner(model, config, engine_config), tokenizer, engine_config)


def generate(engine, loras: list, max_tokens: int, seed: int) -> tuple[float, list[float]]:
    """Aggregate generated tok/s of one request per entry of `loras` (None: the base), all
    queued at once; and the durations of the steps that decoded every one of them."""
    from step_times import StepTimes

    from tokenserve.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps = StepTimes()
    engine.stats = steps
    started = time.perf_counter()
    requests = [engine.make_request(rng.integers(10, vocab - 10, PROMPT_LEN).tolist(), params,
                                    lora=lora) for lora in loras]
    for request in requests:
        engine.add_request(request)
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - started
    return (sum(r.num_generated_tokens for r in requests) / seconds,
            steps.durations(num_decode=len(loras)))


def merged_model(source: str, path: Path):
    """The model of `source` with the adapter at `path` merged into its kernels."""
    from tokenserve.engine.lora_adapter import load_adapter, merged_kernels
    from tokenserve.model.checkpoint import load_source

    model, tokenizer, config = load_source(source)
    deltas = merged_kernels(load_adapter(path, model.config, RANK))
    for block, layer in zip(model.blocks, deltas):
        for role, dense in (("qkv", block.attn.qkv), ("out", block.attn.out),
                            ("up", block.mlp.up), ("down", block.mlp.down)):
            if role in layer:
                dense.kernel.assign_add(layer[role])
    return model, tokenizer, config


def live_load(engine, path: Path, max_tokens: int) -> dict:
    """Check and slot-write times of a new adapter, and what its load adds to the step it
    happens in: with 4 streams decoding, a base request arrives (its prefill joins a step),
    then a request on an adapter not yet in a slot (the same, plus the slot write)."""
    from tokenserve.engine.lora_adapter import LoraRequest
    from tokenserve.sampling import SamplingParams

    started = time.perf_counter()
    weights = engine.loras.check(path)
    check_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(4):
        engine.add_request(engine.make_request([11 + i] * PROMPT_LEN, params))

    def steps(count: int) -> list[float]:
        times = []
        for _ in range(count):
            before = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - before)
        return times
    decode = steps(4)
    engine.add_request(engine.make_request([5] * PROMPT_LEN, params))
    base_arrival = steps(1)[0]
    decode += steps(4)
    lora = LoraRequest.new("fresh", path)
    engine.loras.remember(lora, weights)  # as /v1/load_lora_adapter leaves it
    loads = engine.loras.num_slot_loads
    engine.add_request(engine.make_request([7] * PROMPT_LEN, params, lora=lora))
    lora_arrival = steps(1)[0]
    assert engine.loras.num_slot_loads == loads + 1  # this step wrote its slot
    decode += steps(4)
    while engine.has_work:
        engine.step()
    median = statistics.median(decode)
    return {"check_s": check_s, "median_decode_step_s": median,
            "base_arrival_step_s": base_arrival, "load_arrival_step_s": lora_arrival,
            "load_step_vs_median": lora_arrival / median,
            "load_step_vs_base_arrival": lora_arrival / base_arrival}


def measure(source: str, args, console) -> dict:
    from tokenserve.engine.lora_adapter import LoraRequest
    from tokenserve.model.checkpoint import load_source

    with console.status(f"loading {source}"):
        model, tokenizer, config = load_source(source)
    directory = Path(tempfile.mkdtemp(prefix="tokenserve-lora-bench-"))
    paths = make_adapters(model, directory, 5)
    engine = build_engine(model, tokenizer, config, max_loras=4)
    merged = build_engine(*merged_model(source, paths[0]), max_loras=0)
    loras = [LoraRequest.new(f"a{i}", path) for i, path in enumerate(paths[:4])]
    jobs = {"base-32": (engine, [None] * 32), "lora-32x4": (engine, [loras[i % 4]
                                                                      for i in range(32)]),
            "base-1": (engine, [None]), "lora-1": (engine, [loras[0]]),
            "merged-1": (merged, [None])}
    with console.status("warming up every step kind"):
        for system, (which, entries) in jobs.items():
            generate(which, entries, 4, seed=0)
    results: dict[str, list] = {s: [] for s in SYSTEMS}
    step_medians: dict[str, list] = {s: [] for s in SYSTEMS}
    for round_index in range(args.rounds):
        for system in rotated(list(SYSTEMS), round_index):
            which, entries = jobs[system]
            with console.status(f"{source}: round {round_index + 1}, {system}"):
                tok_s, steps = generate(which, entries, args.max_tokens, seed=round_index)
            results[system].append(tok_s)
            if steps:
                step_medians[system].append(statistics.median(steps))
    with console.status(f"{source}: live load"):
        live_load(engine, paths[4], args.max_tokens)  # its step kinds, traced once
        load = live_load(engine, paths[4], args.max_tokens)
    return {"tok_s": {s: spread(v) for s, v in results.items()},
            "decode_step_ms": {s: spread([1e3 * x for x in v]) for s, v in step_medians.items()
                               if v},
            "ratios": {"lora-32x4 / base-32": statistics.median(results["lora-32x4"])
                       / statistics.median(results["base-32"]),
                       "lora-1 / base-1": statistics.median(results["lora-1"])
                       / statistics.median(results["base-1"]),
                       "lora-1 / merged-1": statistics.median(results["lora-1"])
                       / statistics.median(results["merged-1"])},
            "live_load": load, "precision": engine.runner.precision,
            "lora_table_mib": engine.runner.step.lora_table.num_bytes / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "smollm2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max_tokens", type=int, default=48)
    args = parser.parse_args()
    console = make_console()
    workload = {"prompt_tokens": PROMPT_LEN, "max_tokens": args.max_tokens, "rank": RANK,
                "rounds": args.rounds}
    for source in args.models:  # one result file per model
        report = {"workload": workload, "models": {}}
        found = measure(source, args, console)
        report["models"][source] = found
        table = make_table(f"{source} ({found['precision']}), tok/s, median of {args.rounds}",
                           ["system", "tok/s", "decode step ms"], left=("system",))
        for system in SYSTEMS:
            step = found["decode_step_ms"].get(system, {}).get("median")
            table.add_row(system, f"{found['tok_s'][system]['median']:.1f}",
                          "" if step is None else f"{step:.1f}")
        console.print(table)
        for name, ratio in found["ratios"].items():
            console.print(f"  {name}: {ratio:.2f}x")
        load = found["live_load"]
        console.print(
            f"  live load of a rank-{RANK} adapter: check (read, off the engine thread) "
            f"{load['check_s'] * 1e3:.0f} ms; under 4 decoding streams (median step "
            f"{load['median_decode_step_s'] * 1e3:.0f} ms) a request's arrival step took "
            f"{load['base_arrival_step_s'] * 1e3:.0f} ms on the base and "
            f"{load['load_arrival_step_s'] * 1e3:.0f} ms with its adapter's slot write "
            f"({load['load_step_vs_median']:.2f}x the median step)")
        path = result_path("lora", source)
        info = write_result(path, **report)
        console.print(f"{machine_summary(info)}; noisy shared machine: compare within this "
                      f"run. Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
