"""Multi-turn chat with a shared system prompt: no prefix caching vs local prefix caching vs
two replicas sharing a Redis KV tier (each conversation's turns alternate between them,
conversation i starting on replica i % 2, as a round-robin balancer spreads a burst), with
two controls of two replicas without Redis (turns alternating, or conversations sticky).

Workload: CONVERSATIONS conversations x TURNS turns, run concurrently; every conversation
starts with the same SYSTEM-token system prompt; each turn adds a USER-token user message
and a 64-token greedy answer, and the next turn resends the whole history (token ids, as a
chat client does). Model: GPT-2 small's architecture with random weights and the built-in
tokenizer, its learned position table extended to 2,048 positions (GPT-2's 1,024 cannot
hold six turns after a 1,000-token system prompt; the per-token cost is GPT-2 small's).

    python benchmarks/multiturn.py            # 16 x 6, as specified
    python benchmarks/multiturn.py --quick    # 4 x 3: minutes on a 2-core machine

Prints a table, writes benchmarks/results/multiturn[-quick].json (`--name` names another
file; rewritten after every mode, so a run cut short keeps what it measured) and a PNG of
TTFT by turn. The replicas run in this process (two engines, each with its own KV cache),
against a redis-server the script starts on a free loopback port in a temporary directory.
Every engine is warmed up (its step traced for prefill and for several decode groups) on
unrelated prompts before it is timed, and the counters below exclude the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, free_port, machine_info, machine_summary, pyplot, write_json

ANSWER_TOKENS = 64
MODES = ("no-cache", "local", "redis-2-replicas", "alternate-2-replicas", "sticky-2-replicas")
DEFAULT_MODES = MODES
# Two controls with local caching only (no Redis): alternate-2-replicas routes turns as
# redis-2-replicas does, so each replica recomputes what the other one computed; in
# sticky-2-replicas each conversation stays on one replica, which shows what two
# replicas sharing this machine's cores cost.
# the feature's goals: TTFT P50 of turns 2+ as a fraction of no-cache's, and throughput
GOALS = {"local": {"max_ttft_ratio": 0.30, "min_throughput_ratio": 2.0},
         "redis-2-replicas": {"max_ttft_ratio": 0.40, "min_throughput_ratio": 2.0}}
WARMUP_PROMPT_TOKENS = (600, 250, 120, 60, 30, 12, 5, 3)  # mixed lengths: several decode groups


def log(text: str) -> None:
    print(text, flush=True)


def export_model(base: Path, max_seq_len: int) -> Path:
    """The newest complete export under `base`, made (GPT-2 small, random weights) if none."""
    existing = sorted((p for p in base.glob("[0-9]*") if (p / "saved_model.pb").exists()
                       and (p / "variables" / "variables.index").exists()),
                      key=lambda p: int(p.name))
    if existing:
        return existing[-1]
    from tokenserve.config import GenerationConfig, gpt2_config
    from tokenserve.export.exporter import export_model as export
    from tokenserve.model import build_model
    from tokenserve.model.checkpoint import BUILTIN_DIR
    from tokenserve.model.tokenizer import Tokenizer

    log(f"exporting GPT-2 small ({max_seq_len} positions, random weights) to {base} ...")
    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    architecture = gpt2_config(max_seq_len=max_seq_len)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="gpt2-small-2k")
    return export(build_model(architecture, seed=0), tokenizer, config, base, jit_compile=False)


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    import redis

    port = free_port()
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind",
                                "127.0.0.1", "--dir", str(directory), "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return process, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server did not answer on port {port}")


@dataclasses.dataclass
class Progress:
    """Logs each turn once every conversation has finished it."""

    mode: str
    num_conversations: int
    started: float = dataclasses.field(default_factory=time.perf_counter)
    done: dict = dataclasses.field(default_factory=dict)  # turn -> TTFTs so far

    def turn_done(self, turn: int, ttft_s: float) -> None:
        ttfts = self.done.setdefault(turn, [])
        ttfts.append(ttft_s)
        if len(ttfts) == self.num_conversations:
            log(f"  [{self.mode}] turn {turn} done by all {self.num_conversations} "
                f"conversations at {time.perf_counter() - self.started:6.1f} s "
                f"(TTFT P50 {statistics.median(ttfts):.3f} s)")


async def conversation(engines, index: int, system: list[int], turns: list[list[int]],
                       results: list, progress: Progress, sticky: bool) -> None:
    from tokenserve.sampling import SamplingParams

    history = list(system)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True)
    for turn, user in enumerate(turns):
        # Alternate replicas turn by turn, starting conversations on replicas in turn, as a
        # round-robin balancer would: each turn's burst is split between the replicas
        # instead of landing on one while the other idles. Or keep the conversation on one.
        replica = (index if sticky else index + turn) % len(engines)
        history += user
        started, first, answer, cached = time.perf_counter(), None, [], None
        async for output in engines[replica].generate(history, params, f"c{index}-t{turn}"):
            if first is None and output.outputs and output.outputs[0].token_ids:
                first = time.perf_counter()
            if output.finished:
                cached = output.num_cached_tokens
            for piece in output.outputs:
                answer += piece.token_ids
        results.append({"conversation": index, "turn": turn + 1, "replica": replica,
                        "arrival": started, "first": first,
                        "ttft_s": first - started, "latency_s": time.perf_counter() - started,
                        "prompt_tokens": len(history), "cached_tokens": cached,
                        "output_tokens": len(answer)})
        progress.turn_done(turn + 1, first - started)
        history += answer


async def warm_up(engine, vocab: int, seed: int) -> None:
    """Traces the step on prompts unrelated to the workload (prefill, several decode groups)."""
    import numpy as np

    from tokenserve.sampling import SamplingParams

    rng = np.random.default_rng(1000 + seed)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def one(i: int, length: int) -> None:
        prompt = rng.integers(10, vocab, length).tolist()
        async for _ in engine.generate(prompt, params, f"warmup-{seed}-{i}"):
            pass

    await asyncio.gather(*[one(i, n) for i, n in enumerate(WARMUP_PROMPT_TOKENS)])


def stats_delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


async def run_mode(name: str, model_dir: Path, args, redis_url: str | None) -> dict:
    import numpy as np

    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.engine.config import EngineConfig

    config = EngineConfig(max_num_seqs=args.conversations,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_cache_tokens=args.cache_tokens, precision="float32",
                          enable_prefix_caching=name != "no-cache",
                          kv_store=redis_url if name == "redis-2-replicas" else None)
    num_replicas = 2 if name.endswith("-2-replicas") else 1
    log(f"[{name}] loading and warming up {num_replicas} engine(s) ...")
    loading = time.perf_counter()
    engines = [AsyncEngine.from_model_dir(model_dir, config, model_name="gpt2", version="1")
               for _ in range(num_replicas)]
    vocab = engines[0].config.model.vocab_size
    for i, engine in enumerate(engines):
        await warm_up(engine, vocab, i)
    warm = [dataclasses.asdict(e.engine.prefix_cache_stats()) for e in engines]
    log(f"[{name}] ready in {time.perf_counter() - loading:.1f} s; running "
        f"{args.conversations} conversations x {args.turns} turns")
    rng = np.random.default_rng(0)  # the same workload in every mode
    system = rng.integers(10, vocab, args.system_tokens).tolist()
    turns = [[rng.integers(10, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    results: list = []
    progress = Progress(name, args.conversations)
    started = time.perf_counter()
    await asyncio.gather(*[conversation(engines, i, system, turns[i], results, progress,
                                        sticky=name.startswith("sticky"))
                           for i in range(args.conversations)])
    wall = time.perf_counter() - started
    stats = [stats_delta(dataclasses.asdict(e.engine.prefix_cache_stats()), w)
             for e, w in zip(engines, warm)]
    for engine in engines:
        engine.shutdown()
        if engine.engine.scheduler.kv_tier is not None:  # its last writes, before Redis stops
            engine.engine.scheduler.kv_tier.close(wait=True)
    by_turn = {t: [r["ttft_s"] for r in results if r["turn"] == t]
               for t in range(1, args.turns + 1)}
    later = [r["ttft_s"] for r in results if r["turn"] >= 2]
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached_tokens = sum(r["cached_tokens"] or 0 for r in results)
    log(f"[{name}] done in {wall:.1f} s; {cached_tokens / prompt_tokens:.0%} of prompt tokens "
        f"served from a cache")
    return {"mode": name, "replicas": len(engines), "wall_s": wall,
            "output_tokens_per_s": sum(r["output_tokens"] for r in results) / wall,
            "ttft_p50_turns_2_plus_s": statistics.median(later) if later else None,
            "ttft_p50_turn_1_s": statistics.median(by_turn[1]),
            "ttft_p50_by_turn_s": {t: statistics.median(v) for t, v in by_turn.items()},
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached_tokens,
            "prefix_cache": stats, "requests": sorted(
                results, key=lambda r: (r["conversation"], r["turn"]))}


def compare(modes: list[dict]) -> None:
    """Adds ratios to no-cache and the goals' verdicts to each mode."""
    base = next((m for m in modes if m["mode"] == "no-cache"), None)
    for mode in modes:
        if base is None or mode is base or not base["ttft_p50_turns_2_plus_s"]:
            continue
        mode["ttft_ratio_to_no_cache"] = (mode["ttft_p50_turns_2_plus_s"]
                                          / base["ttft_p50_turns_2_plus_s"])
        mode["throughput_ratio_to_no_cache"] = (mode["output_tokens_per_s"]
                                                / base["output_tokens_per_s"])
        goal = GOALS.get(mode["mode"])
        if goal:
            mode["goals"] = {**goal, "ttft_met": mode["ttft_ratio_to_no_cache"]
                             <= goal["max_ttft_ratio"],
                             "throughput_met": mode["throughput_ratio_to_no_cache"]
                             >= goal["min_throughput_ratio"]}


def print_table(modes: list[dict]) -> None:
    log(f"{'mode':<22}{'TTFT P50 t1 (s)':>16}{'TTFT P50 t2+ (s)':>18}{'vs no-cache':>12}"
        f"{'out tok/s':>11}{'vs no-cache':>12}{'cached':>8}")
    for mode in modes:
        ttft = mode.get("ttft_ratio_to_no_cache")
        tput = mode.get("throughput_ratio_to_no_cache")
        log(f"{mode['mode']:<22}{mode['ttft_p50_turn_1_s']:>16.3f}"
            f"{mode['ttft_p50_turns_2_plus_s']:>18.3f}"
            f"{'' if ttft is None else f'{ttft:.0%}':>12}{mode['output_tokens_per_s']:>11.1f}"
            f"{'' if tput is None else f'{tput:.2f}x':>12}"
            f"{mode['cached_prompt_tokens'] / mode['prompt_tokens']:>8.0%}")
    for mode in modes:
        if "goals" in mode:
            goals = mode["goals"]
            log(f"goal {mode['mode']}: TTFT t2+ <= {goals['max_ttft_ratio']:.0%} of no-cache: "
                f"{'met' if goals['ttft_met'] else 'MISSED'}; throughput >= "
                f"{goals['min_throughput_ratio']:.0f}x: "
                f"{'met' if goals['throughput_met'] else 'MISSED'}")


def plot(report: dict, path: Path) -> None:
    import matplotlib.ticker

    plt = pyplot()
    workload = report["workload"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for mode in report["modes"]:
        turns = sorted(mode["ttft_p50_by_turn_s"], key=int)
        ax.plot([int(t) for t in turns], [mode["ttft_p50_by_turn_s"][t] for t in turns],
                marker="o", label=f"{mode['mode']} ({mode['output_tokens_per_s']:.0f} out tok/s)")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT P50 (s)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(range(1, workload["turns"] + 1))
    ax.set_title(f"{workload['conversations']} conversations x {workload['turns']} turns, "
                 f"{workload['system_tokens']}-token shared system prompt\n"
                 f"GPT-2 small (random weights), {report['machine']['cpu_count']} CPUs",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, name: str) -> None:
    write_json(RESULTS / f"{name}.json", report, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 conversations x 3 turns")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system_tokens", type=int, default=1000)
    parser.add_argument("--user_tokens", type=int, default=100)
    parser.add_argument("--max_num_batched_tokens", type=int, default=512)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--model_dir", default=str(Path(tempfile.gettempdir())
                                                   / "tokenserve-bench" / "gpt2-small-2k"),
                        help="base path of a GPT-2-small export with >= 2,048 positions "
                             "(exported there if it holds none)")
    parser.add_argument("--name", default=None,
                        help="result file stem under benchmarks/results (default: multiturn, "
                             "or multiturn-quick with --quick)")
    parser.add_argument("--note", default=None,
                        help="a remark stored in the JSON (e.g. why the workload was reduced)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.quick:
        args.conversations, args.turns = 4, 3
    modes_wanted = args.modes.split(",")
    unknown = set(modes_wanted) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    longest = args.system_tokens + args.turns * (args.user_tokens + ANSWER_TOKENS)
    args.cache_tokens = args.conversations * longest + 4096  # room for every conversation
    machine = machine_info()
    log(machine_summary(machine))
    model_dir = export_model(Path(args.model_dir), max_seq_len=2048)
    report = {"workload": {"conversations": args.conversations, "turns": args.turns,
                           "system_tokens": args.system_tokens,
                           "user_tokens": args.user_tokens, "answer_tokens": ANSWER_TOKENS,
                           "quick": args.quick, "note": args.note},
              "model": {"export": str(model_dir), "architecture": "gpt2-small (random weights)",
                        "max_seq_len": 2048, "precision": "float32", "kv_cache": "16-bit"},
              "engine": {"max_num_seqs": args.conversations,
                         "max_num_batched_tokens": args.max_num_batched_tokens,
                         "max_cache_tokens": args.cache_tokens, "block_size": 16},
              "redis_server": subprocess.run(["redis-server", "--version"], capture_output=True,
                                             text=True).stdout.strip(),
              "command": " ".join(["python", "benchmarks/multiturn.py"] + sys.argv[1:]),
              "machine": machine, "goals": GOALS, "complete": False, "modes": []}
    name = args.name or ("multiturn-quick" if args.quick else "multiturn")
    tmp = Path(tempfile.mkdtemp(prefix="multiturn-redis-"))
    redis_process, redis_url = start_redis(tmp)
    started = time.perf_counter()
    try:
        for mode in modes_wanted:
            report["modes"].append(asyncio.run(run_mode(mode, model_dir, args, redis_url)))
            compare(report["modes"])
            write(report, name)
    finally:
        redis_process.kill()
        redis_process.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    report["complete"] = True
    report["total_s"] = time.perf_counter() - started
    write(report, name)
    plot(report, RESULTS / f"{name}.png")
    print_table(report["modes"])
    log(f"wrote {RESULTS / name}.json and .png ({report['total_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
