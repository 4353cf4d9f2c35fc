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

The one-stream systems are also run interleaved step by step (--interleaved_steps decode
steps each, one engine per system, their steps taken in turn: base, adapter, merged), so
each sees the same load at the same moments; their median decode steps and the median of
the paired ratios are the one-stream figures this shared machine resolves best.

Then the live load, isolated from any prefill: with 4 streams decoding on the base and no
request arriving, a rank-16 adapter is checked on another thread (read, parse, fuse: the
load endpoint's part) and then written into a slot between two steps (the engine's part);
each window's largest gap between the streams' tokens against their median gap (the
target: a load under 1 s, no gap above 2x the median inter-token latency).

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


def interleaved(engines: dict, loras: dict, steps: int) -> dict:
    """One stream per engine (system name -> engine; loras: its adapter or None), their
    decode steps taken in turn, the order rotating each round. Median step ms per system
    and, per system, the median over rounds of its step / base-1's step of that round."""
    from step_times import StepTimes

    from tokenserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for name, engine in engines.items():
        engine.stats = StepTimes()
        engine.add_request(engine.make_request(list(range(20, 20 + PROMPT_LEN)), params,
                                               lora=loras[name]))
        for _ in range(3):  # the prefill and the first decode steps
            engine.step()
        engine.stats.clear()
    names = list(engines)
    for round_index in range(steps):
        for name in rotated(names, round_index):
            engines[name].step()
    times = {name: engine.stats.durations(num_decode=1) for name, engine in engines.items()}
    for engine in engines.values():
        while engine.has_work:
            engine.step()
    base = times["base-1"]
    return {"step_ms": {name: spread([1e3 * t for t in v]) for name, v in times.items()},
            "paired_vs_base": {name: statistics.median(t / b for t, b in zip(v, base))
                               for name, v in times.items() if name != "base-1"}}


def live_load(engine, path: Path) -> dict:
    """What loading a new adapter live costs streams that do not use it: 4 streams decode on
    the base, and no request arrives while the adapter is (1) checked on another thread, as
    /v1/load_lora_adapter checks it (read, parse, fuse: off the engine's thread), then (2)
    written into a slot between two steps, as the engine writes it before its first
    request's step. Each window's largest gap between the streams' tokens (step end to step
    end) against their median gap."""
    import threading

    from tokenserve.engine.lora_adapter import LoraRequest
    from tokenserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=256, ignore_eos=True)  # aborted at the end
    streams = [engine.make_request([11 + i] * PROMPT_LEN, params) for i in range(4)]
    for request in streams:
        engine.add_request(request)
    last = [time.perf_counter()]

    def gap() -> float:  # one step; the time since the last step ended
        engine.step()
        now = time.perf_counter()
        gap, last[0] = now - last[0], now
        return gap
    for _ in range(3):  # the prompts' prefill, and the first decode steps
        gap()
    decode = [gap() for _ in range(6)]
    lora = LoraRequest.new("fresh", path)
    checked = {}

    def check():
        started = time.perf_counter()
        engine.loras.check(path, lora)  # into the host cache, as the endpoint leaves it
        checked["s"] = time.perf_counter() - started
    thread = threading.Thread(target=check)
    thread.start()
    check_gaps = []
    while thread.is_alive() or not check_gaps:
        check_gaps.append(gap())
    thread.join()
    check_gaps.append(gap())  # the step the check's end overlapped
    decode += [gap() for _ in range(6)]
    # the slot write, between two steps, with no prefill in the window (the adapter's
    # request is not queued)
    request = engine.make_request([7] * PROMPT_LEN, params, lora=lora)
    loads = engine.loras.num_slot_loads
    started = time.perf_counter()
    failed = engine.loras.assign([request.seqs[0]], engine.scheduler.running)
    write_s = time.perf_counter() - started
    assert not failed and engine.loras.num_slot_loads == loads + 1  # it wrote a slot
    write_gap = gap()
    decode += [gap() for _ in range(6)]
    for stream in streams:
        engine.abort(stream.request_id)
    while engine.has_work:
        engine.step()
    median = statistics.median(decode)
    return {"check_s": checked["s"], "slot_write_s": write_s, "median_gap_s": median,
            "check_max_gap_s": max(check_gaps), "write_gap_s": write_gap,
            "check_gap_vs_median": max(check_gaps) / median,
            "write_gap_vs_median": write_gap / median}


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
    with console.status(f"{source}: one stream, interleaved step by step"):
        single = build_engine(model, tokenizer, config, max_loras=4)  # base-1's own
        steps = interleaved({"base-1": single, "lora-1": engine, "merged-1": merged},
                            {"base-1": None, "lora-1": loras[0], "merged-1": None},
                            args.interleaved_steps)
    with console.status(f"{source}: live load"):
        live_load(engine, paths[4])  # its step kinds, traced once
        load = live_load(engine, paths[4])
    return {"tok_s": {s: spread(v) for s, v in results.items()},
            "decode_step_ms": {s: spread([1e3 * x for x in v]) for s, v in step_medians.items()
                               if v},
            "ratios": {"lora-32x4 / base-32": statistics.median(results["lora-32x4"])
                       / statistics.median(results["base-32"]),
                       "lora-1 / base-1": statistics.median(results["lora-1"])
                       / statistics.median(results["base-1"]),
                       "lora-1 / merged-1": statistics.median(results["lora-1"])
                       / statistics.median(results["merged-1"]),
                       "interleaved step, lora-1 / base-1": steps["paired_vs_base"]["lora-1"],
                       "interleaved step, merged-1 / base-1":
                           steps["paired_vs_base"]["merged-1"]},
            "interleaved": steps,
            "live_load": load, "precision": engine.runner.precision,
            "lora_table_mib": engine.runner.step.lora_table.num_bytes / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "smollm2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--interleaved_steps", type=int, default=100,
                        help="decode steps of each one-stream system, interleaved")
    args = parser.parse_args()
    console = make_console()
    workload = {"prompt_tokens": PROMPT_LEN, "max_tokens": args.max_tokens, "rank": RANK,
                "rounds": args.rounds, "interleaved_steps": args.interleaved_steps}
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
        console.print("  interleaved one-stream decode step, median ms: " + ", ".join(
            f"{n} {v['median']:.1f}" for n, v in found["interleaved"]["step_ms"].items()))
        load = found["live_load"]
        console.print(
            f"  live load of a rank-{RANK} adapter under 4 base streams (median gap "
            f"{load['median_gap_s'] * 1e3:.0f} ms): check (off the engine's thread) "
            f"{load['check_s'] * 1e3:.0f} ms, largest gap meanwhile "
            f"{load['check_max_gap_s'] * 1e3:.0f} ms ({load['check_gap_vs_median']:.2f}x); "
            f"slot write {load['slot_write_s'] * 1e3:.0f} ms, its gap "
            f"{load['write_gap_s'] * 1e3:.0f} ms ({load['write_gap_vs_median']:.2f}x)")
        path = result_path("lora", source)
        info = write_result(path, **report)
        console.print(f"{machine_summary(info)}; noisy shared machine: compare within this "
                      f"run. Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
