#!/usr/bin/env python
"""Memory footprint and time to ready of `tokenserve serve`, measured from outside.

For each configuration the script launches `tokenserve serve` on one model, polls the
OpenAI API until the model is listed (time to ready), reads the process's resident memory
from /proc (VmRSS idle, then after 32 concurrent requests, each read 2.5 s after the
last response, when the engine has trimmed its heap; the reading the moment the burst
ends is kept too, "RSS at burst end"; VmHWM: the peak), scrapes the
`tokenserve:memory_bytes{kind=...}` gauges and keeps the server's startup memory line.
RSS is reported whole and in its two parts, anonymous (RssAnon: heap, weights, KV cache)
and file-backed (RssFile: mapped pages of shared libraries, clean and reclaimable), and as
PSS (smaps_rollup: shared pages divided among the processes that map them).

Starts:
  first   an empty XLA persistent cache (a fresh directory): every XLA program compiles.
          The custom-op libraries stay built (scripts/setup.sh builds them at install; the
          script builds them first for its environment, e.g. an ISA cap's
          TOKENSERVE_KERNELS_MARCH, so a first start does not time g++).
  second  the same cache directory again, warm from the first start.

Models: GPT-2-small (random weights, `tokenserve export gpt2-small --output DIR --no-xla`)
with 32 sequences x 1,024 tokens of KV pool, and the built-in transformer (`tokenserve
serve` with no model flags).

Targets: GPT-2-small RSS <= 2.2 GB; built-in <= 700 MB; ready <= 10 s on a second start
and <= 20 s on a first start (GPT-2-small).

Output: a table, benchmarks/results/footprint.json.

Run:  python benchmarks/footprint.py [--gpt2 /tmp/headline/gpt2-float32] [--only builtin]
          [--serve_args="--release_file_pages=false"] [--tag nodrop]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import (RESULTS, make_console, make_table, machine_info, machine_summary, serve,
                    write_json)
from headline import export

NUM_REQUESTS = 32
SETTLE_S = 2.5  # seconds before reading memory, at idle and after the burst
console = make_console(160)


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile (/proc/PID/status) and Pss
    (/proc/PID/smaps_rollup) of a process, in bytes. RssFile is mostly TensorFlow's shared
    libraries (page cache, shared between processes)."""
    values = {}
    for path, names in ((f"/proc/{pid}/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile")),
                        (f"/proc/{pid}/smaps_rollup", ("Pss",))):
        for line in Path(path).read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in names:
                values[name] = int(rest.split()[0]) * 1024
    return values


def memory_gauges(text: str) -> dict[str, int]:
    gauges = {}
    for match in re.finditer(r'^tokenserve:memory_bytes\{[^}]*kind="([^"]+)"[^}]*\} (\S+)$',
                             text, re.M):
        gauges[match.group(1)] = int(float(match.group(2)))
    return gauges


def run_server(label: str, model_args: list[str], flags: list[str], xla_dir: Path,
               model_id: str, prompt_words: int, max_tokens: int) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={xla_dir}")
    with serve([*model_args, "--metrics_public", *flags], f"footprint-{label}.log",
               env) as server:
        url, log_path = server.url, server.log_path
        ready_s = server.wait_until_serving(timeout_s=900, poll_s=0.1,
                                            accept=lambda answer: model_id in answer.text)
        time.sleep(SETTLE_S)  # let the allocator settle
        pid = server.process.pid
        idle = proc_memory(pid)
        gauges = memory_gauges(httpx.get(url + "/metrics", timeout=10).text)
        prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (prompt_words // 9))

        def one(_):
            return httpx.post(url + "/v1/completions", timeout=900, json={
                "model": model_id, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True}).status_code
        burst_started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            codes = list(pool.map(one, range(NUM_REQUESTS)))
        burst_s = time.monotonic() - burst_started
        just_after = proc_memory(pid)
        time.sleep(SETTLE_S)  # as before the idle reading: the engine trims its heap when idle
        loaded = proc_memory(pid)
        log_lines = log_path.read_text().splitlines()
        memory_lines = [line.strip() for line in log_lines if "memory:" in line]
        phase_lines = [line.strip() for line in log_lines if "ready in" in line
                       or "phases" in line]
        return {"ready_s": ready_s, "rss_idle": idle["VmRSS"], "rss_anon_idle": idle["RssAnon"],
                "rss_file_idle": idle["RssFile"], "pss_idle": idle["Pss"],
                "rss_loaded": loaded["VmRSS"], "rss_peak": loaded["VmHWM"],
                "rss_just_after": just_after["VmRSS"],
                "rss_anon_just_after": just_after["RssAnon"],
                "rss_anon_loaded": loaded["RssAnon"], "rss_file_loaded": loaded["RssFile"],
                "pss_loaded": loaded["Pss"], "gauges": gauges,
                "requests_ok": sum(code == 200 for code in codes), "burst_s": burst_s,
                "burst_tokens_per_s": NUM_REQUESTS * max_tokens / burst_s,
                "memory_log": memory_lines[-1] if memory_lines else None,
                "phase_log": phase_lines[-3:], "flags": flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpt2", default="/tmp/headline/gpt2-float32",
                        help="a GPT-2-small export (made with `tokenserve export gpt2-small "
                             "--output DIR --no-xla` when missing)")
    parser.add_argument("--only", choices=["gpt2", "builtin"], default=None)
    parser.add_argument("--kv_cache_dtype", default=None,
                        help="passed to serve (default: serve's own default)")
    parser.add_argument("--serve_args", default="",
                        help="more `tokenserve serve` flags, space-separated "
                             "(e.g. --release_file_pages=false)")
    parser.add_argument("--tag", default="", help="appended to each run's label")
    parser.add_argument("--output", default=str(RESULTS / "footprint.json"))
    args = parser.parse_args()
    console.print(machine_summary(machine_info()))
    # the custom ops for this environment's ISA (TOKENSERVE_KERNELS_MARCH), as
    # scripts/setup.sh builds them at install: a first start measures XLA's compiles only
    subprocess.run([sys.executable, "-m", "tokenserve.kernels.build"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gpt2 = Path(args.gpt2)
    if args.only != "builtin":
        export(gpt2, "none")
    common = ["--max_num_seqs", "32"] + (
        [f"--kv_cache_dtype={args.kv_cache_dtype}"] if args.kv_cache_dtype else []) + (
        args.serve_args.split())
    models = {
        "gpt2-small": (["--model_name", "gpt2", "--model_base_path", str(gpt2)], "gpt2",
                       common + ["--kv_cache_tokens", str(32 * 1024)], 120, 16),
        "builtin": ([], "builtin", common, 60, 16),
    }
    results = {}
    for name, (model_args, model_id, flags, words, max_tokens) in models.items():
        if args.only and not name.startswith(args.only):
            continue
        xla_dir = Path(tempfile.mkdtemp(prefix=f"footprint-xla-{name}-"))
        for start in ("first", "second"):
            label = f"{name}-{start}" + (f"-{args.tag}" if args.tag else "")
            console.print(f"{label}: serving ...")
            results[label] = run_server(label, model_args, flags, xla_dir, model_id, words,
                                        max_tokens)
            console.print(results[label])
    table = make_table("tokenserve serve: memory and time to ready",
                       ("run", "ready s", "RSS idle MB", "anon idle", "file idle", "PSS idle",
                        "RSS at burst end", "RSS after 32 req MB", "anon", "file", "PSS",
                        "peak MB", "requests ok", "burst tok/s"))
    for label, r in results.items():
        table.add_row(label, f"{r['ready_s']:.1f}", *(f"{r[key] / 1e6:.0f}" for key in (
            "rss_idle", "rss_anon_idle", "rss_file_idle", "pss_idle", "rss_just_after",
            "rss_loaded",
            "rss_anon_loaded", "rss_file_loaded", "pss_loaded", "rss_peak")),
                      f"{r['requests_ok']}/{NUM_REQUESTS}", f"{r['burst_tokens_per_s']:.0f}")
    console.print(table)
    for label, r in results.items():
        console.print(f"{label}: {r['memory_log']}")
    write_json(Path(args.output), {"machine": machine_info(), "results": results})
    console.print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
