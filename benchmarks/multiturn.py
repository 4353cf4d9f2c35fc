"""Multi-turn chat with a shared system prompt: no prefix caching vs local prefix caching vs
two replicas sharing a Redis KV tier (each conversation's turns alternate between them).

Workload: CONVERSATIONS conversations x TURNS turns, run concurrently; every conversation
starts with the same SYSTEM-token system prompt; each turn adds a USER-token user message
and a 64-token greedy answer, and the next turn resends the whole history (token ids, as a
chat client does). Model: GPT-2 small's architecture with random weights and the built-in
tokenizer, its learned position table extended to 2,048 positions (GPT-2's 1,024 cannot
hold six turns after a 1,000-token system prompt; the per-token cost is GPT-2 small's).

    python benchmarks/multiturn.py            # 16 x 6, as specified
    python benchmarks/multiturn.py --quick    # 4 x 3: minutes on a 2-core machine

Prints a table, writes benchmarks/results/multiturn[-quick].json and a PNG of TTFT by turn.
The replicas run in this process (two engines, each with its own KV cache), against a
redis-server the script starts on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ANSWER_TOKENS = 64


def export_model(base: Path, max_seq_len: int) -> Path:
    from tokenserve.config import GenerationConfig, gpt2_config
    from tokenserve.export.exporter import export_model as export
    from tokenserve.model import build_model
    from tokenserve.model.tokenizer import Tokenizer
    from tokenserve.model.checkpoint import BUILTIN_DIR

    existing = sorted(p for p in base.glob("[0-9]*") if p.is_dir())
    if existing:
        return existing[-1]
    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    architecture = gpt2_config(max_seq_len=max_seq_len)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="gpt2-small-2k")
    return export(build_model(architecture, seed=0), tokenizer, config, base, jit_compile=False)


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind",
                                "127.0.0.1", "--dir", str(directory), "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


async def conversation(engines, index: int, system: list[int], turns: list[list[int]],
                       results: list) -> None:
    from tokenserve.sampling import SamplingParams

    history = list(system)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True)
    for turn, user in enumerate(turns):
        engine = engines[turn % len(engines)]  # alternate replicas turn by turn
        history += user
        started, first, answer = time.perf_counter(), None, []
        async for output in engine.generate(history, params, f"c{index}-t{turn}"):
            if first is None and output.outputs and output.outputs[0].token_ids:
                first = time.perf_counter()
            for piece in output.outputs:
                answer += piece.token_ids
        results.append({"conversation": index, "turn": turn + 1, "ttft_s": first - started,
                        "prompt_tokens": len(history), "output_tokens": len(answer)})
        history += answer


async def run_mode(name: str, model_dir: Path, args, redis_url: str | None) -> dict:
    import numpy as np

    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.engine.config import EngineConfig

    config = EngineConfig(max_num_seqs=args.conversations, max_num_batched_tokens=512,
                          max_cache_tokens=args.cache_tokens, precision="float32",
                          enable_prefix_caching=name != "no-cache",
                          kv_store=redis_url if name == "redis-2-replicas" else None)
    engines = [AsyncEngine.from_model_dir(model_dir, config, model_name="gpt2", version="1")
               for _ in range(2 if name == "redis-2-replicas" else 1)]
    rng = np.random.default_rng(0)
    vocab = engines[0].config.model.vocab_size
    system = rng.integers(10, vocab, args.system_tokens).tolist()
    turns = [[rng.integers(10, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    results: list = []
    started = time.perf_counter()
    await asyncio.gather(*[conversation(engines, i, system, turns[i], results)
                           for i in range(args.conversations)])
    wall = time.perf_counter() - started
    stats = [dataclasses.asdict(e.engine.prefix_cache_stats()) for e in engines]
    for engine in engines:
        engine.shutdown()
    by_turn = {t: [r["ttft_s"] for r in results if r["turn"] == t]
               for t in range(1, args.turns + 1)}
    later = [r["ttft_s"] for r in results if r["turn"] >= 2]
    return {"mode": name, "wall_s": wall,
            "output_tokens_per_s": sum(r["output_tokens"] for r in results) / wall,
            "ttft_p50_turns_2_plus_s": statistics.median(later) if later else None,
            "ttft_p50_by_turn_s": {t: statistics.median(v) for t, v in by_turn.items()},
            "prefix_cache": stats, "requests": results}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in report["modes"]:
        turns = sorted(mode["ttft_p50_by_turn_s"], key=int)
        ax.plot([int(t) for t in turns], [mode["ttft_p50_by_turn_s"][t] for t in turns],
                marker="o", label=mode["mode"])
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT P50 (s)")
    ax.set_title(f"{report['workload']['conversations']} conversations x "
                 f"{report['workload']['turns']} turns, {report['workload']['system_tokens']}"
                 f"-token shared system prompt")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 conversations x 3 turns")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system_tokens", type=int, default=1000)
    parser.add_argument("--user_tokens", type=int, default=100)
    parser.add_argument("--modes", default="no-cache,local,redis-2-replicas")
    parser.add_argument("--model_dir", default=str(Path(tempfile.gettempdir())
                                                   / "tokenserve-bench" / "gpt2-small-2k"))
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns = 4, 3
    longest = args.system_tokens + args.turns * (args.user_tokens + ANSWER_TOKENS)
    args.cache_tokens = args.conversations * longest + 4096  # room for every conversation
    model_dir = export_model(Path(args.model_dir), max_seq_len=2048)
    tmp = Path(tempfile.mkdtemp(prefix="multiturn-redis-"))
    redis_process, redis_url = start_redis(tmp)
    try:
        modes = [asyncio.run(run_mode(m, model_dir, args, redis_url))
                 for m in args.modes.split(",")]
    finally:
        redis_process.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"workload": {"conversations": args.conversations, "turns": args.turns,
                           "system_tokens": args.system_tokens,
                           "user_tokens": args.user_tokens, "answer_tokens": ANSWER_TOKENS,
                           "quick": args.quick},
              "machine": machine_info(), "modes": modes}
    base = next((m for m in modes if m["mode"] == "no-cache"), None)
    print(f"{'mode':<18}{'TTFT P50 t2+ (s)':>18}{'vs no-cache':>13}{'out tok/s':>11}"
          f"{'vs no-cache':>13}")
    for mode in modes:
        ratio_ttft = (mode["ttft_p50_turns_2_plus_s"] / base["ttft_p50_turns_2_plus_s"]
                      if base else float("nan"))
        ratio_tput = (mode["output_tokens_per_s"] / base["output_tokens_per_s"]
                      if base else float("nan"))
        print(f"{mode['mode']:<18}{mode['ttft_p50_turns_2_plus_s']:>18.3f}{ratio_ttft:>12.0%}"
              f"{mode['output_tokens_per_s']:>11.1f}{ratio_tput:>12.2f}x")
    RESULTS.mkdir(exist_ok=True)
    name = "multiturn-quick" if args.quick else "multiturn"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    plot(report, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
