#!/usr/bin/env python
"""What structured output costs: output tok/s at 32 concurrent streams, constrained vs free,
and the time to first token a cached schema adds.

Model: the built-in model (default) or any export (`--model DIR`), through the real
AsyncEngine in this process (no HTTP), greedy.

Throughput: `--concurrency` (32) requests at once, each generating up to `--max-tokens` (128):
  free        no constraint, eos ignored (every request makes exactly max_tokens tokens);
  json        a JSON schema (an array of 32 to 64 small objects with enums, bounded integers
              and strings), at least 32 items, so every request runs to max_tokens;
  regex       `[a-z_]+( [a-z_]+)*` (any lowercase words), always runs to max_tokens.
Reported as generated tokens / wall time over `--rounds` rounds (best round).

TTFT: one request at a time, max_tokens=1, `--ttft-reps` times, free and with the JSON schema
already compiled once (cached); the median difference is the added TTFT.

Writes benchmarks/results/structured.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SCHEMA = {"type": "array", "minItems": 32, "maxItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "kind", "name"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "kind": {"enum": ["file", "dir", "link"]},
                   "name": {"type": "string", "maxLength": 12}}}}
REGEX = r"[a-z_]+( [a-z_]+)*"
PROMPTS = ["def main():", "import os\n", "# files\nentries = ", "class Config:", "x = ",
           "for item in items:", "# parse the arguments\n", "return "]


async def run_round(engine, params_of, concurrency: int, tokenizer) -> tuple[int, float]:
    from tokenserve.sampling import SamplingParams  # noqa: F401 - params_of builds them

    async def one(i: int) -> int:
        ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        count = 0
        async for out in engine.generate(ids, params_of(i), f"bench-{time.monotonic()}-{i}"):
            count += sum(len(o.token_ids) for o in out.outputs)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return sum(counts), time.perf_counter() - started


async def ttft(engine, params, tokenizer, reps: int) -> list[float]:
    times = []
    ids = tokenizer.encode("# files\nentries = ")
    for i in range(reps):
        started = time.perf_counter()
        async for _ in engine.generate(ids, params, f"ttft-{time.monotonic()}-{i}"):
            times.append(time.perf_counter() - started)
            break
    return times


async def main_async(args) -> dict:
    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.engine.config import EngineConfig
    from tokenserve.sampling import GuideKind, SamplingParams, StructuredOutput

    if args.model:
        model_dir = Path(args.model)
    else:
        from tokenserve.export.cached_exports import builtin_export
        model_dir = builtin_export()
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(max_num_seqs=args.concurrency))
    tokenizer = engine.tokenizer
    schema = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    regex = StructuredOutput(GuideKind.REGEX, REGEX)
    workloads = {
        "free": lambda i: SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        "json": lambda i: SamplingParams(max_tokens=args.max_tokens, structured=schema),
        "regex": lambda i: SamplingParams(max_tokens=args.max_tokens, structured=regex),
    }
    results = {}
    try:
        await run_round(engine, workloads["free"], args.concurrency, tokenizer)  # warm up
        await run_round(engine, workloads["json"], args.concurrency, tokenizer)
        for name, params_of in workloads.items():
            rounds = [await run_round(engine, params_of, args.concurrency, tokenizer)
                      for _ in range(args.rounds)]
            best = max(rounds, key=lambda r: r[0] / r[1])
            results[name] = {"tokens": best[0], "seconds": best[1],
                             "tok_per_s": best[0] / best[1],
                             "all_tok_per_s": [r[0] / r[1] for r in rounds]}
        free_ttft = await ttft(engine, SamplingParams(max_tokens=1), tokenizer, args.ttft_reps)
        json_ttft = await ttft(engine, SamplingParams(max_tokens=1, structured=schema),
                               tokenizer, args.ttft_reps)
    finally:
        engine.shutdown()
    free = results["free"]["tok_per_s"]
    for name in ("json", "regex"):
        results[name]["vs_free"] = results[name]["tok_per_s"] / free - 1.0
    return {
        "model": str(model_dir), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "throughput": results,
        "ttft_ms": {"free_median": statistics.median(free_ttft) * 1e3,
                    "json_cached_median": statistics.median(json_ttft) * 1e3,
                    "added_median": (statistics.median(json_ttft)
                                     - statistics.median(free_ttft)) * 1e3,
                    "reps": args.ttft_reps},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an export directory (default: the built-in model)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-reps", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "structured.json"))
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(f"\n{'workload':<10}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs free':>9}")
    for name, row in report["throughput"].items():
        delta = f"{row['vs_free']:+.1%}" if "vs_free" in row else ""
        print(f"{name:<10}{row['tokens']:>8}{row['seconds']:>9.2f}{row['tok_per_s']:>9.0f}"
              f"{delta:>9}")
    t = report["ttft_ms"]
    print(f"\nTTFT median: free {t['free_median']:.1f} ms, cached JSON schema "
          f"{t['json_cached_median']:.1f} ms, added {t['added_median']:+.2f} ms")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
