#!/usr/bin/env python
"""The headline comparison: one stream and 32 streams, tokenserve against its peers.

Workload: GPT-2 small (124M, random weights), 32-token random prompts, 128 new tokens,
greedy, ignore_eos. Same machine, same run, each system in its own process:

  serve-<fmt>    `tokenserve serve` (float32 and int8 exports; `--precision auto`), measured
                 from outside with `tokenserve bench` (an OpenAI streaming client):
                 1 stream = 8 requests at concurrency 1; 32 streams = 64 requests at
                 concurrency 32. TTFT and ITL are the client's.
  llm-<fmt>      `tokenserve.LLM` in-process: one prompt, then 32 prompts at once.
  hf-tf-xla      Hugging Face transformers' TF GPT-2, `generate` compiled with XLA, batch 1
                 and static batch 8 (its own venv: bash benchmarks/peers/setup_hf_tf.sh).
  llamacpp-<t>   llama.cpp through llama-cpp-python's OpenAI server, on the same weights
                 written as GGUF (benchmarks/peers/gpt2_gguf.py; t = f32 or q8_0, its 8-bit
                 format), a thread per usable CPU, measured with the same client at 1 stream. That server
                 runs one request at a time, so it has no 32-stream figure (its own venv:
                 bash benchmarks/peers/setup_llama_cpp.sh).

"1 stream unstreamed": 8 more requests one at a time without streaming, tokens counted from
each answer's usage over the wall time (tokenserve and llama.cpp alike). llama.cpp's server
streams no usage and renders the random model's tokens past the tokenizer's 8,192 as empty
text, so the streaming client cannot count its tokens: this column is the like-for-like one
for one stream; its TTFT and ITL come from the streaming client as tokenserve's do.

Everything is float32 unless the row says int8. Prints a table, writes
benchmarks/results/headline.json (or --output) with the machine's CPU flags and ISA caps,
and the memory read rate of the hour (read_bandwidth.py): one float32 stream's ceiling.
To approximate an AVX2-only CPU on a bigger one:

    ONEDNN_MAX_CPU_ISA=AVX2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 TOKENSERVE_KERNELS_MARCH=avx2 \\
        python benchmarks/headline.py
"""


from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import (RESULTS, TOKENSERVE, Server, make_console, make_table, machine_info,
                    machine_summary, serve, write_json)
from peer_systems import (HF_SETUP, HF_VENV, LLAMA_CPP_SETUP, LLAMA_CPP_VENV, gguf_of,
                          hf_peer_python, llama_cpp_server, llama_cpp_threads, run_hf_cli)
from read_bandwidth import read_bandwidth

PYTHON = sys.executable
console = make_console(150)
PROMPT_LEN, NEW_TOKENS = 32, 128


def export(base: Path, quantize: str) -> Path:
    if not base.exists():
        console.print(f"exporting gpt2-small ({quantize}) to {base} ...")
        subprocess.run([TOKENSERVE, "export", "gpt2-small", "--output", str(base), "--no-xla",
                        "--quantize", quantize], check=True, stdout=subprocess.DEVNULL)
    return base


def client_run(url: str, concurrency: int, num_requests: int, prompt_len: int = PROMPT_LEN,
               new_tokens: int = NEW_TOKENS) -> dict:
    """One `tokenserve bench` run (the OpenAI streaming client) against `url`: its result."""
    out = Path(tempfile.mkdtemp(prefix="headline-"))
    try:
        subprocess.run(
            [TOKENSERVE, "bench", "--base-url", url, "--model", "gpt2",
             "--num-prompts", str(num_requests), "--max-concurrency", str(concurrency),
             "--random-input-len", str(prompt_len), "--random-output-len", str(new_tokens),
             "--ignore-eos", "--disable-tqdm", "--result-dir", str(out)],
            check=True, stdout=subprocess.DEVNULL)
        return json.loads((out / "results.json").read_text())["runs"][0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench_serve(base: Path, label: str, points: list[tuple[int, int]]) -> dict:
    """Starts `tokenserve serve` on `base`, runs `tokenserve bench` for each
    (concurrency, requests) point, stops the server."""
    with serve(["--model_name", "gpt2", "--model_base_path", str(base)],
               f"headline-{label}.log") as server:
        server.wait_until_serving(timeout_s=600)
        results = {}
        for concurrency, num_requests in points:
            run = client_run(server.url, concurrency, num_requests)
            results[concurrency] = {k: run[k] for k in (
                "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms",
                "p50_tpot_ms", "completed", "failed")}
        # one stream again without streaming, measured as the llama.cpp peer is
        results[1]["unstreamed"] = count_tokens_unstreamed(server.url, 8, base)
        chose = [line.strip() for line in open(server.log_path) if "computing in" in line]
        return {"points": results, "precision_log": chose[-1] if chose else None}


LLM_WORKER = """
import json, sys, time
import numpy as np
from tokenserve import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=32)
params = SamplingParams(max_tokens={new}, ignore_eos=True)
rng = np.random.default_rng(0)
def run(n):
    prompts = [[int(t) for t in rng.integers(0, 50000, {prompt})] for _ in range(n)]
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
run(1); run(32)
print(json.dumps({{"1": max(run(1) for _ in range(3)), "32": run(32),
                  "precision": llm.engine.runner.precision}}))
"""


def bench_llm(base: Path) -> dict:
    code = LLM_WORKER.format(new=NEW_TOKENS, prompt=PROMPT_LEN)
    out = subprocess.run([PYTHON, "-c", code, str(base)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_hf(venv: Path, batch_sizes: list[int]) -> dict:
    python = hf_peer_python(venv)
    if python is None:
        return {"skipped": f"no {venv}: run {HF_SETUP}"}
    results = {}
    for batch in batch_sizes:
        run = run_hf_cli(python, ["--batch-size", str(batch), "--prompt-len", str(PROMPT_LEN),
                                  "--new-tokens", str(NEW_TOKENS), "--repeats", "3"])
        results[batch] = {"tok_s": run["median"]["tok_s"],
                          "ttft_est_ms": run["median"]["ttft_est_s"] * 1e3,
                          "runs": [{k: r[k] for k in ("wall_s", "tok_s")} for r in run["runs"]]}
    return results


def prompt_texts(export_dir: Path):
    """Endless random 32-token prompts as text, the same sequence on every call (ids drawn
    from 300 up, seed 1, decoded by the export's tokenizer). The tokenizer is loaded here,
    not on the first draw, so a timed loop does not pay for it."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(export_dir.glob("*/assets/tokenizer.json"))))
    rng = np.random.default_rng(1)

    def texts():
        while True:
            yield tokenizer.decode(
                rng.integers(300, tokenizer.get_vocab_size(), PROMPT_LEN).tolist())

    return texts()


def count_tokens_unstreamed(url: str, num_requests: int, export_dir: Path) -> dict:
    """Sends `num_requests` random 32-token prompts one at a time without streaming;
    {"output_throughput": completion tokens per second of wall time, "tokens": per request}."""
    texts = prompt_texts(export_dir)
    tokens, started = [], time.perf_counter()
    for _ in range(num_requests):
        answer = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "gpt2", "prompt": next(texts), "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True})
        answer.raise_for_status()
        tokens.append(answer.json()["usage"]["completion_tokens"])
    return {"output_throughput": sum(tokens) / (time.perf_counter() - started),
            "tokens": tokens}


def bench_llama_cpp(venv: Path, export_dir: Path, workdir: Path, qtype: str) -> dict:
    """llama-cpp-python's server on the GGUF of `export_dir`'s weights, at 1 stream."""
    python = venv / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no {venv}: run {LLAMA_CPP_SETUP}"}
    gguf = gguf_of(export_dir, workdir, qtype)
    with llama_cpp_server(python, gguf, f"headline-llamacpp-{qtype}.log") as server:
        server.wait_until_serving(timeout_s=300)
        run = llama_cpp_client_run(server)
        # The server streams no usage, and the random model's tokens past the tokenizer's
        # 8,192 render as empty text, so the client cannot count streamed tokens: output
        # tok/s comes from the same requests sent without streaming, whose usage is exact
        # (tokens / wall time, one request at a time, as the client's throughput is).
        counted = count_tokens_unstreamed(server.url, 8, export_dir)
        version = subprocess.run([str(python), "-c", "import llama_cpp; "
                                  "print(llama_cpp.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        return {"points": {1: {**{k: run[k] for k in (
                    "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "completed",
                    "failed")}, "unstreamed": counted}},
                "llama_cpp_python": version, "threads": llama_cpp_threads()}


def llama_cpp_client_run(server: Server) -> dict:
    """client_run at one stream, saying so when the llama.cpp server died during it."""
    try:
        return client_run(server.url, 1, 8)
    except subprocess.CalledProcessError as error:
        if server.process.poll() is None:
            raise
        raise RuntimeError(f"llama_cpp.server exited with status {server.process.returncode} "
                           f"during the run (a negative status is a signal); see "
                           f"{server.log_path}") from error


def load_report(path: Path) -> dict:
    """The systems already in a result file (`--append`), with JSON's string keys of the
    points and batch sizes made ints again."""
    systems = json.loads(path.read_text())["systems"]
    for name, result in systems.items():
        if name.startswith(("serve", "llamacpp")) and "points" in result:
            result["points"] = {int(k): v for k, v in result["points"].items()}
        elif name.startswith("hf") and "skipped" not in result:
            systems[name] = {int(k): v for k, v in result.items()}
    return systems


def print_table(report: dict) -> None:
    table = make_table("GPT-2 small, 32-token prompt, 128 new tokens, greedy (output tok/s)",
                       ("system", "1 stream", "1 stream unstreamed", "TTFT p50 ms",
                        "ITL p50 ms", "32 streams", "ITL p50 ms @32", "notes"),
                       left=("system", "notes"))
    for name, result in report["systems"].items():
        if name.startswith("serve"):
            one, many = result["points"][1], result["points"][32]
            unstreamed = one.get("unstreamed", {}).get("output_throughput")
            table.add_row(f"tokenserve serve ({name[6:]})", f"{one['output_throughput']:.1f}",
                          f"{unstreamed:.1f}" if unstreamed else "",
                          f"{one['p50_ttft_ms']:.0f}", f"{one['p50_itl_ms']:.1f}",
                          f"{many['output_throughput']:.1f}", f"{many['p50_itl_ms']:.1f}",
                          (result["precision_log"] or "").split("computing in ")[-1][:60])
        elif name.startswith("llamacpp") and "points" in result:
            one = result["points"][1]
            table.add_row(f"llama.cpp server ({name[9:]})", "",
                          f"{one['unstreamed']['output_throughput']:.1f}",
                          f"{one['p50_ttft_ms']:.0f}", f"{one['p50_itl_ms']:.1f}", "", "",
                          f"llama-cpp-python {result['llama_cpp_python']}, "
                          f"{result['threads']} threads, one request at a time")
        elif name.startswith("llm"):
            table.add_row(f"tokenserve.LLM ({name[4:]})", f"{result['1']:.1f}", "", "", "",
                          f"{result['32']:.1f}", "", "in-process, 32 prompts at once")
        elif "skipped" in result:
            table.add_row(name, "", "", "", "", "", "", result["skipped"])
        else:
            table.add_row("HF TF + XLA generate", f"{result[1]['tok_s']:.1f}", "",
                          f"~{result[1]['ttft_est_ms']:.0f}", "", f"{result[8]['tok_s']:.1f}",
                          "", "batch 1 / static batch 8; TTFT estimated")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "headline")
    parser.add_argument("--hf-venv", type=Path, default=HF_VENV)
    parser.add_argument("--llama-cpp-venv", type=Path, default=LLAMA_CPP_VENV)
    parser.add_argument("--systems", nargs="+",
                        default=["serve-float32", "serve-int8", "llm-float32", "llm-int8", "hf",
                                 "llamacpp-f32", "llamacpp-q8_0"])
    parser.add_argument("--output", type=Path, default=RESULTS / "headline.json")
    parser.add_argument("--append", action="store_true",
                        help="keep the systems already in --output (run them one at a time)")
    args = parser.parse_args(argv)

    machine = machine_info()
    console.print(machine_summary(machine))
    # the hour's memory read rate: one float32 stream cannot beat it (read_bandwidth.py)
    machine["read_bandwidth"] = read_bandwidth(reps=5)
    console.print("read bandwidth: {one_thread_gb_s:.1f} GB/s one thread, {all_threads_gb_s:.1f} "
                  "GB/s {threads} threads".format(**machine["read_bandwidth"]))
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = {fmt: args.workdir / f"gpt2-{fmt}" for fmt in ("float32", "int8")}
    report = {"workload": {"model": "gpt2-small random", "prompt_tokens": PROMPT_LEN,
                           "new_tokens": NEW_TOKENS, "greedy": True, "ignore_eos": True},
              "machine": machine, "systems": {}}
    if args.append and args.output.exists():
        report["systems"] = load_report(args.output)
    for system in args.systems:
        console.print(f"[bold]{system}[/bold] ...")
        if system == "hf" or system.startswith("llamacpp-"):
            # A peer that fails (llama.cpp's q8_0 crashed on an AMX Xeon) is recorded as
            # such and the run goes on; a tokenserve failure stops it.
            name = "hf-tf-xla" if system == "hf" else system
            try:
                report["systems"][name] = (
                    bench_hf(args.hf_venv, [1, 8]) if system == "hf" else bench_llama_cpp(
                        args.llama_cpp_venv, export(models["float32"], "none"), args.workdir,
                        system.split("-")[1]))
            except (subprocess.CalledProcessError, RuntimeError, httpx.HTTPError) as error:
                console.print(f"[red]{system} failed[/red]: {error}")
                report["systems"][name] = {"skipped": f"failed: {error}"[:300]}
        else:
            kind, fmt = system.split("-")
            base = export(models[fmt], "none" if fmt == "float32" else "int8")
            if kind == "serve":
                report["systems"][system] = bench_serve(base, system, [(1, 8), (32, 64)])
            else:
                report["systems"][system] = bench_llm(base)
        write_json(args.output, report)  # partial results survive
    print_table(report)
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
