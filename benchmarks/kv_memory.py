#!/usr/bin/env python
"""Memory with default flags: SmolLM2-135M's Q4_1 file as stored, 32 slots of 2,048, against
llama.cpp's server on the same file with the same slots, in one run.

Systems (--systems):
  default    `tokenserve serve --max_num_seqs 32` on the export of `--context 2048`: the KV
             pool takes the default budget and its pages become resident as blocks are
             written
  eager      the same with `--kv_cache_lazy_pages=false`: the whole pool resident at load
  old        `--kv_cache_tokens 65536 --kv_cache_lazy_pages=false`: a pool for every slot
             at full length, all resident (the same-file table's command before)
  llamacpp   llama-cpp-python's server with `--n_ctx 65536` (its KV buffer is cleared at
             load, so all of it is resident from the start)

Phases, each read from /proc (VmRSS, RssAnon, RssFile) 2.5 s after it ends:
  ready  the server answers /v1/models
  short  the same-file table's 32-stream run: 64 requests at concurrency 32, 32-token
         prompts, 128 new tokens, greedy, ignore_eos
  fill   (default only) 26 requests at concurrency 32 of 1,400-token prompts (of the
         bench's tokenizer: about 1,800 of SmolLM2's) and 64 new tokens: about 48,000
         positions of traffic, more than the default pool's 46,576, so
         every block is written at least once (prefix caching keeps freed blocks' contents,
         and a fresh block is taken before a cached one is evicted): the most a pool of
         that budget can hold resident

Prints a table and writes benchmarks/results/kv-memory-smollm2[-NAME].json with the machine's
flags and the servers' KV log lines. The machine is shared: quote ratios from one run.

    .venv/bin/python benchmarks/kv_memory.py [--workdir /tmp/gguf-stored-bench]
        [--systems default eager old llamacpp (default: default old llamacpp)] [--name NAME]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, serve,
                    write_json)
from footprint import proc_memory
from gguf_stored import CONTEXT, SLOTS, export, gguf_path
from headline import client_run
from peer_systems import LLAMA_CPP_SETUP, LLAMA_CPP_VENV, llama_cpp_server

console = make_console(150)
SETTLE_S = 2.5  # the engine trims its heap after 1 s idle
FLAGS = {"default": [], "eager": ["--kv_cache_lazy_pages=false"],
         "old": ["--kv_cache_tokens", str(SLOTS * CONTEXT), "--kv_cache_lazy_pages=false"]}
SYSTEMS = (*FLAGS, "llamacpp")
PHASES = {"short": dict(concurrency=32, num_requests=64, prompt_len=32, new_tokens=128),
          "fill": dict(concurrency=32, num_requests=26, prompt_len=1400, new_tokens=64)}


def reading(pid: int) -> dict[str, int]:
    time.sleep(SETTLE_S)
    memory = proc_memory(pid)
    return {k: memory[k] for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def run_phases(server, phases: list[str], serial: bool = False) -> dict:
    """serial: a server that answers one request at a time gets half the requests (as in
    gguf_stored.py), the same concurrency."""
    ready_s = server.wait_until_serving(timeout_s=900)
    result = {"ready_s": ready_s, "memory": {"ready": reading(server.process.pid)}}
    for phase in phases:
        workload = dict(PHASES[phase])
        if serial:
            workload["num_requests"] //= 2
        run = client_run(server.url, **workload)
        result["memory"][phase] = reading(server.process.pid)
        result[f"{phase}_tok_s"] = run["output_throughput"]
        result[f"{phase}_failed"] = run["failed"]
    return result


def bench(system: str, base: Path, gguf: Path) -> dict:
    label = f"kv-memory-{system}.log"
    if system == "llamacpp":
        python = LLAMA_CPP_VENV / "bin" / "python"
        if not python.exists():
            return {"skipped": f"no {LLAMA_CPP_VENV}: run {LLAMA_CPP_SETUP}"}
        with llama_cpp_server(python, gguf, label, n_ctx=SLOTS * CONTEXT) as server:
            return run_phases(server, ["short"], serial=True)
    flags = ["--model_name", "gpt2", "--model_base_path", str(base), "--max_num_seqs",
             str(SLOTS), *FLAGS[system]]
    with serve(flags, label) as server:
        # a pool resident from the start holds no more after filling it
        result = run_phases(server, ["short", "fill"] if system == "default" else ["short"])
        result["log"] = [line.strip() for line in open(server.log_path)
                         if "KV cache:" in line or "KV pool:" in line or "memory:" in line]
        return result


def print_table(report: dict) -> None:
    table = make_table(f"SmolLM2-135M Q4_1, {SLOTS} slots of {CONTEXT}: RSS MiB after each "
                       f"phase (anonymous + file)", ["system", "ready", "short", "fill",
                                                     "peak", "short tok/s"],
                       left=(0,), caption=machine_summary(report["machine"]))
    peer = report["systems"].get("llamacpp", {}).get("memory", {}).get("short", {})

    def cell(memory: dict | None) -> str:
        if not memory:
            return ""
        text = (f"{memory['VmRSS'] / 2**20:,.0f} ({memory['RssAnon'] / 2**20:,.0f} + "
                f"{memory['RssFile'] / 2**20:,.0f})")
        return text + (f" = {memory['VmRSS'] / peer['VmRSS']:.2f}x" if peer else "")

    for system, row in report["systems"].items():
        if "skipped" in row:
            table.add_row(system, row["skipped"], "", "", "", "")
            continue
        memory = row["memory"]
        peak = max(m["VmHWM"] for m in memory.values())
        table.add_row(system, cell(memory["ready"]), cell(memory["short"]),
                      cell(memory.get("fill")), f"{peak / 2**20:,.0f}",
                      f"{row['short_tok_s']:.1f}")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gguf-stored-bench"))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        default=["default", "old", "llamacpp"])
    parser.add_argument("--name", default="", help="suffix of the result file")
    args = parser.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    output = RESULTS / f"kv-memory-smollm2{'-' + args.name if args.name else ''}.json"
    gguf = gguf_path("smollm2", args.workdir)
    base = export(args.workdir, "smollm2", gguf, "stored")
    report = {"machine": machine_info(), "phases": PHASES, "slots": SLOTS, "context": CONTEXT,
              "systems": {}}
    for system in args.systems:
        console.print(f"measuring {system} ...")
        report["systems"][system] = bench(system, base, gguf)
        write_json(output, report)  # partial results survive
    print_table(report)
    console.print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
