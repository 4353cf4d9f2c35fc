#!/usr/bin/env python
"""SmolLM2-135M-Instruct's Q4_1 file served four ways, in one run: tokenserve's default import
(the file's Q4_1 and Q8_0 blocks as stored), its float32 and int8 imports, and llama.cpp on
the file as it is. One stream and 32 streams, plus the server's memory.

  stored    `tokenserve export smollm2` (default: blocks as stored), `tokenserve serve`
  float32   `tokenserve export smollm2 --dtype float32`
  int8      `tokenserve export smollm2 --quantize int8`
  llamacpp  llama-cpp-python's OpenAI server on the .gguf (its own venv:
            bash benchmarks/peers/setup_llama_cpp.sh); it runs one request at a time, so
            it gets the 1-stream point only

Each tokenserve system is exported once into WORKDIR (reused by later runs) with context
2048 (the packaged default), served with default flags, and measured from outside with
`tokenserve bench` (the OpenAI streaming client, as headline.py): 1 stream = 8 requests at
concurrency 1, 32 streams = 64 requests at concurrency 32; random 32-token prompts, 128 new
tokens, greedy, ignore_eos. "1 stream unstreamed" counts completion tokens from each answer's
usage over wall time (the llama.cpp server streams no usage; headline.py explains). Memory:
the server's VmRSS after the 32-stream run and its peak (VmHWM), from /proc.

Prints a table and writes benchmarks/results/gguf-stored[-NAME].json with the machine's flags.

    .venv/bin/python benchmarks/gguf_stored.py [--workdir DIR] [--systems stored int8 ...]
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from common import (RESULTS, TOKENSERVE, make_console, make_table, machine_info,
                    machine_summary, serve, write_json)
from footprint import proc_memory
from headline import client_run, count_tokens_unstreamed, llama_cpp_client_run
from peer_systems import LLAMA_CPP_SETUP, LLAMA_CPP_VENV, llama_cpp_server

console = make_console(150)
EXPORTS = {"stored": [], "float32": ["--dtype", "float32"], "int8": ["--quantize", "int8"]}
SYSTEMS = (*EXPORTS, "llamacpp")
POINTS = [(1, 8), (32, 64)]
KEYS = ("output_throughput", "p50_ttft_ms", "p50_itl_ms", "completed", "failed")


def export(workdir: Path, system: str) -> Path:
    base = workdir / f"smollm2-{system}"
    if not base.exists():
        console.print(f"exporting smollm2 ({system}) to {base} ...")
        subprocess.run([TOKENSERVE, "export", "smollm2", "--output", str(base),
                        *EXPORTS[system]], check=True, stdout=subprocess.DEVNULL)
    return base


def bench_tokenserve(base: Path, system: str) -> dict:
    with serve(["--model_name", "gpt2", "--model_base_path", str(base)],
               f"gguf-stored-{system}.log") as server:
        ready_s = server.wait_until_serving(timeout_s=900)
        points = {}
        for concurrency, num_requests in POINTS:
            run = client_run(server.url, concurrency, num_requests)
            points[concurrency] = {k: run[k] for k in KEYS}
        memory = proc_memory(server.process.pid)
        points[1]["unstreamed"] = count_tokens_unstreamed(server.url, 8, base)
        log = [line.strip() for line in open(server.log_path)
               if "KV cache:" in line or "GGUF blocks" in line or "computing in" in line]
        return {"points": points, "ready_s": ready_s, "rss": memory["VmRSS"],
                "rss_peak": memory["VmHWM"], "log": log}


def bench_llama_cpp(gguf: Path, export_dir: Path) -> dict:
    python = LLAMA_CPP_VENV / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no {LLAMA_CPP_VENV}: run {LLAMA_CPP_SETUP}"}
    with llama_cpp_server(python, gguf, "gguf-stored-llamacpp.log") as server:
        server.wait_until_serving(timeout_s=300)
        run = llama_cpp_client_run(server)
        memory = proc_memory(server.process.pid)
        counted = count_tokens_unstreamed(server.url, 8, export_dir)
        return {"points": {1: {**{k: run.get(k) for k in KEYS}, "unstreamed": counted}},
                "rss": memory["VmRSS"], "rss_peak": memory["VmHWM"]}


def print_table(report: dict) -> None:
    table = make_table("SmolLM2-135M-Instruct Q4_1: tokenserve's imports and llama.cpp "
                       "(tok/s; noisy shared 2-core VM)",
                       ["system", "1 stream", "1 unstreamed", "TTFT p50 ms", "ITL p50 ms",
                        "32 streams", "failed", "RSS MiB", "peak MiB"], left=(0,),
                       caption=machine_summary(report["machine"]))
    base = report["systems"].get("llamacpp", {}).get("points", {}).get(1, {})
    base_tps = (base.get("unstreamed") or {}).get("output_throughput")
    for system, result in report["systems"].items():
        if "skipped" in result:
            table.add_row(system, result["skipped"], *[""] * 7)
            continue
        one, many = result["points"][1], result["points"].get(32, {})
        unstreamed = one["unstreamed"]["output_throughput"]
        ratio = f" = {unstreamed / base_tps:.2f}x" if base_tps and system != "llamacpp" else ""
        table.add_row(system, f"{one['output_throughput'] or 0:.1f}",
                      f"{unstreamed:.1f}{ratio}", f"{one['p50_ttft_ms'] or 0:.0f}",
                      f"{one['p50_itl_ms'] or 0:.1f}",
                      f"{many['output_throughput']:.1f}" if many else "-",
                      str(many.get("failed", one.get("failed"))),
                      f"{result['rss'] / 2**20:,.0f}", f"{result['rss_peak'] / 2**20:,.0f}")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gguf-stored-bench"))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--name", default="", help="suffix of the result file")
    args = parser.parse_args(argv)
    from tokenserve.model.checkpoint import packaged_gguf  # TensorFlow: after --help

    args.workdir.mkdir(parents=True, exist_ok=True)
    output = RESULTS / f"gguf-stored{'-' + args.name if args.name else ''}.json"
    report = {"machine": machine_info(), "prompt_tokens": 32, "new_tokens": 128,
              "points": POINTS, "systems": {}}
    exports = {system: export(args.workdir, system) for system in args.systems
               if system in EXPORTS}
    for system in args.systems:
        console.print(f"measuring {system} ...")
        if system == "llamacpp":
            tokenizer_source = next(iter(exports.values()), None) or export(args.workdir,
                                                                           "stored")
            result = bench_llama_cpp(packaged_gguf("smollm2"), tokenizer_source)
        else:
            result = bench_tokenserve(exports[system], system)
        report["systems"][system] = result
        write_json(output, report)  # partial results survive
    print_table(report)
    console.print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
