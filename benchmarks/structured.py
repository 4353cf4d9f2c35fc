#!/usr/bin/env python
"""What structured output costs: output tok/s at 32 concurrent streams, constrained vs free,
and the time to first token a cached schema adds.

Model: the built-in model (default) or any export (`--model DIR`), through the real
AsyncEngine in this process (no HTTP), greedy unless `--temperature` is set (then every
request samples at that temperature, seeded).

Throughput: `--concurrency` (32) requests at once, each generating up to `--max-tokens` (128):
  free        no constraint, eos ignored (every request makes exactly max_tokens tokens);
  json        a JSON schema (an array of 32 to 64 small objects with enums, bounded integers
              and strings), at least 32 items, so every request runs to max_tokens;
  regex       `[a-z_]+( [a-z_]+)*` (any lowercase words), always runs to max_tokens.
Reported as generated tokens / wall time, best of `--rounds` rounds (15). The rounds take
turns (free, json, regex, free, ...) so that a slow spell of a shared machine hits every
workload alike; each round's own ratio to the free round beside it is kept too
(`paired_vs_free`, median in `median_paired_vs_free`).

TTFT: one request at a time, max_tokens=1, `--ttft-reps` times each, free and with the JSON
schema already compiled once (cached), taking turns; the median difference is the added TTFT.

Writes benchmarks/results/structured.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from common import RESULTS, machine_info, write_json

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


async def ttft(engine, params, tokenizer) -> float:
    ids = tokenizer.encode("# files\nentries = ")
    started = time.perf_counter()
    async for _ in engine.generate(ids, params, f"ttft-{time.monotonic()}"):
        break
    return time.perf_counter() - started


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
    def params(i: int, **constraint) -> SamplingParams:
        seed = None if args.temperature == 0.0 else i
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=seed, **constraint)

    workloads = {
        "free": lambda i: params(i, ignore_eos=True),
        "json": lambda i: params(i, structured=schema),
        "regex": lambda i: params(i, structured=regex),
    }
    rounds = {name: [] for name in workloads}
    free_ttft, json_ttft = [], []
    try:
        await run_round(engine, workloads["free"], args.concurrency, tokenizer)  # warm up
        await run_round(engine, workloads["json"], args.concurrency, tokenizer)
        for _ in range(args.rounds):
            for name, params_of in workloads.items():
                rounds[name].append(await run_round(engine, params_of, args.concurrency,
                                                    tokenizer))
        for _ in range(args.ttft_reps):
            free_ttft.append(await ttft(engine, SamplingParams(max_tokens=1), tokenizer))
            json_ttft.append(await ttft(engine, SamplingParams(max_tokens=1, structured=schema),
                                        tokenizer))
    finally:
        engine.shutdown()
    results = {}
    for name, runs in rounds.items():
        best = max(runs, key=lambda r: r[0] / r[1])
        results[name] = {"tokens": best[0], "seconds": best[1], "tok_per_s": best[0] / best[1],
                         "all_tok_per_s": [n / s for n, s in runs]}
    free = results["free"]
    for name in ("json", "regex"):
        row = results[name]
        row["vs_free"] = row["tok_per_s"] / free["tok_per_s"] - 1.0
        row["paired_vs_free"] = [r / f - 1.0 for r, f in zip(row["all_tok_per_s"],
                                                             free["all_tok_per_s"])]
        row["median_paired_vs_free"] = statistics.median(row["paired_vs_free"])
    return {
        "model": str(model_dir), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "machine": machine_info(),
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
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (default: greedy)")
    parser.add_argument("--ttft-reps", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "structured.json"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    report = asyncio.run(main_async(args))
    print(f"\n{'workload':<10}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'vs free':>9}"
          f"{'paired median':>15}")
    for name, row in report["throughput"].items():
        delta = f"{row['vs_free']:+.1%}" if "vs_free" in row else ""
        paired = (f"{row['median_paired_vs_free']:+.1%}" if "median_paired_vs_free" in row
                  else "")
        print(f"{name:<10}{row['tokens']:>8}{row['seconds']:>9.2f}{row['tok_per_s']:>9.0f}"
              f"{delta:>9}{paired:>15}")
    t = report["ttft_ms"]
    print(f"\nTTFT median: free {t['free_median']:.1f} ms, cached JSON schema "
          f"{t['json_cached_median']:.1f} ms, added {t['added_median']:+.2f} ms")
    write_json(Path(args.out), report, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
