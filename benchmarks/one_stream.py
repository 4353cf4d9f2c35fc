#!/usr/bin/env python
"""One stream, every system at once: interleaved rounds, so a slow minute hits all alike.

On these shared 2-core VMs the memory read rate drifts by up to 1.7x within an hour, and one
decode stream is bound by it. headline.py measures each system in turn over ~12 minutes, so
its ratios carry that drift. Here every system is started first and stays up (idle ones use
no CPU), then each round sends the same kind of request to each of them, one after another,
in an order that rotates by round; the ratios are taken round by round (the same minutes)
and their median is reported, with their spread.

Workload as headline.py's: GPT-2 small (random weights), a random 32-token prompt (sent as
text, as the headline's unstreamed column), 128 new tokens, greedy, eos ignored. With
`--temperature T`, every system samples instead, plainly (no top-k, top-p, min-p or
repetition penalty, as OpenAI's API samples when a request names only a temperature;
llama.cpp's server applies its own defaults for those unless told, so it is told).

  serve-<fmt>     `tokenserve serve` on the float32 and the int8 export; more serve flags
                  as serve-<fmt>:<flag>=<value>, e.g. serve-float32:head_screen=float16
  llamacpp-<t>    llama.cpp's OpenAI server (llama-cpp-python) on the same weights as GGUF
                  f32 and q8_0, a thread per usable CPU (its own venv: bash benchmarks/peers/setup_llama_cpp.sh)
  hf              HF transformers' TF GPT-2, XLA `generate`, batch 1, in a worker that keeps
                  its compiled function (its own venv: bash benchmarks/peers/setup_hf_tf.sh)

A server's figure is completion tokens (from each answer's usage) over the wall time of
`--requests` requests sent one at a time; HF's is generated tokens over `generate`'s time.
ITL: a server's is the median gap between the chunks of one more request, streamed; HF's
(it streams nothing) is one decode step of its `generate`, (N-token call - 2-token call) /
(N - 2).
Prints a table, writes benchmarks/results/one-stream.json (or --output) with the CPU flags
and the read rate at the start and the end, and a PNG of tok/s by round beside it.

    .venv/bin/python benchmarks/one_stream.py --rounds 6
"""


from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from common import (RESULTS, Server, make_console, make_table, machine_info, machine_summary,
                    pyplot, rotated, serve, spread, write_json)
from headline import NEW_TOKENS, PROMPT_LEN, export, prompt_texts
from peer_systems import (HF_SETUP, HF_VENV, LLAMA_CPP_SETUP, LLAMA_CPP_VENV, HFRounds,
                          gguf_of, hf_peer_python, llama_cpp_server)
from read_bandwidth import read_bandwidth

console = make_console(150)
RATIOS = [("serve-float32", "hf"), ("serve-float32", "llamacpp-f32"),
          ("serve-int8", "llamacpp-q8_0"), ("serve-int8", "hf")]


class OpenAISystem:
    """An OpenAI-compatible server in its own process, asked for unstreamed completions."""

    def __init__(self, name: str, server: Server, texts, sampling: dict):
        self.name, self.server, self.texts, self.sampling = name, server, texts, sampling
        self.url = server.url

    def ready(self) -> None:
        self.server.wait_until_serving(timeout_s=600)
        self.measure(1)  # the first request of a process pays one-time costs

    def measure(self, requests: int) -> dict:
        tokens, started = 0, time.perf_counter()
        for _ in range(requests):
            answer = httpx.post(self.url + "/v1/completions", timeout=300, json={
                "model": "gpt2", "prompt": next(self.texts), "max_tokens": NEW_TOKENS,
                "ignore_eos": True, **self.sampling})
            answer.raise_for_status()
            tokens += answer.json()["usage"]["completion_tokens"]
        wall = time.perf_counter() - started
        return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}

    def itl_ms(self) -> float:
        """The median gap between streamed chunks of one more request, in ms (one token a
        chunk, as the OpenAI streaming client measures ITL)."""
        arrivals = []
        with httpx.stream("POST", self.url + "/v1/completions", timeout=300, json={
                "model": "gpt2", "prompt": next(self.texts), "max_tokens": NEW_TOKENS,
                "ignore_eos": True, "stream": True, **self.sampling}) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    arrivals.append(time.perf_counter())
        gaps = np.diff(arrivals[1:])  # from the second chunk: the first carries prefill
        return float(np.median(gaps)) * 1e3

    def stop(self) -> None:
        self.server.stop()


class HFSystem:
    """hf_tf_xla.py in rounds mode: one compiled batch-1 generate per request."""

    def __init__(self, python: Path, temperature: float):
        self.name = "hf"
        self.peer = HFRounds(python, PROMPT_LEN, NEW_TOKENS, temperature, "one-stream-hf.log")

    def ready(self) -> None:
        self.peer.ready()

    def measure(self, requests: int) -> dict:
        tokens, wall, steps = 0, 0.0, []
        for _ in range(requests):
            run = self.peer.generate()
            tokens, wall = tokens + run["generated"], wall + run["wall_s"]
            steps.append(run["step_s"])
        # HF streams nothing: its ITL is one decode step of generate, (N-token call - 2-token
        # call) / (N - 2), as hf_tf_xla.py estimates it
        return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                "itl_ms": statistics.median(steps) * 1e3}

    def stop(self) -> None:
        self.peer.stop()


def sampling_fields(system: str, temperature: float) -> dict:
    """The request's sampling fields: greedy, or plain temperature sampling, spelled out
    for llama.cpp (its server's defaults are top_k 40, top_p 0.95, min_p 0.05 and a
    repetition penalty of 1.1)."""
    if temperature == 0:
        return {"temperature": 0}
    if system.startswith("llamacpp-"):
        return {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "repeat_penalty": 1.0}
    return {"temperature": temperature, "top_p": 1.0}


def start_systems(names: list[str], workdir: Path, hf_venv: Path, llama_venv: Path,
                  temperature: float = 0.0) -> list:
    models = {fmt: export(workdir / f"gpt2-{fmt}", "none" if fmt == "float32" else fmt)
              for fmt in ("float32", "int8")}
    systems = []
    for name in names:
        texts = prompt_texts(models["float32"])
        if name.startswith("serve-"):
            # serve-<fmt>[:<flag>=<value>...]: more serve flags, for an A/B in the same run
            fmt, *flags = name.removeprefix("serve-").split(":")
            extra = [part for flag in flags for part in ("--" + flag.split("=", 1)[0],
                                                         flag.split("=", 1)[1])]
            server = serve(["--model_name", "gpt2", "--model_base_path", str(models[fmt]),
                            *extra], f"one-stream-{name}.log")
            systems.append(OpenAISystem(name, server, texts,
                                        sampling_fields(name, temperature)))
        elif name.startswith("llamacpp-"):
            python = llama_venv / "bin" / "python"
            if not python.exists():
                console.print(f"skipping {name}: run {LLAMA_CPP_SETUP}")
                continue
            gguf = gguf_of(models["float32"], workdir, name.removeprefix("llamacpp-"))
            systems.append(OpenAISystem(name, llama_cpp_server(python, gguf,
                                                               f"one-stream-{name}.log"),
                                        texts, sampling_fields(name, temperature)))
        elif name == "hf":
            python = hf_peer_python(hf_venv)
            if python is None:
                console.print(f"skipping hf: run {HF_SETUP}")
                continue
            systems.append(HFSystem(python, temperature))
    return systems


def round_ratios(rounds: dict, key: str) -> dict:
    """For each pair of RATIOS that ran, and each serve variant (serve-<fmt>:<flags>) against
    its plain serve-<fmt> and HF: the spread of a/b of `key`, taken round by round."""
    variants = [(name, other) for name in rounds if name.startswith("serve-") and ":" in name
                for other in (name.split(":")[0], "hf")]
    return {f"{a} / {b}": spread([x[key] / y[key] for x, y in zip(rounds[a], rounds[b])])
            for a, b in RATIOS + variants if a in rounds and b in rounds}


def plot(report: dict, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rounds in report["rounds"].items():
        ax.plot(range(1, len(rounds) + 1), [r["tok_s"] for r in rounds], marker="o",
                label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("output tok/s, one stream")
    temperature = report["workload"]["temperature"]
    how = f"temperature {temperature:g}" if temperature else "greedy"
    ax.set_title(f"GPT-2 small, 32-token prompt, 128 new tokens, {how}: interleaved rounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(report: dict, args) -> None:
    machine = report["machine"]
    bandwidth = " -> ".join(f"{machine[k]['all_threads_gb_s']:.1f}"
                            for k in ("read_bandwidth_start", "read_bandwidth_end"))
    how = f"temperature {args.temperature:g}" if args.temperature else "greedy"
    table = make_table(f"one stream, {how}, {args.rounds} interleaved rounds of "
                       f"{args.requests} requests (two threads read {bandwidth} GB/s)",
                       ("system", "median tok/s", "min", "max", "ITL p50 ms, median", "min",
                        "max"), left=("system",))
    for name, s in report["tok_s"].items():
        itl = report["itl_ms"][name]
        table.add_row(name, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}",
                      f"{itl['median']:.1f}", f"{itl['min']:.1f}", f"{itl['max']:.1f}")
    console.print(table)
    table = make_table("ratios taken round by round (HF's ITL: one step of generate)",
                       ("ratio", "tok/s median", "min", "max", "ITL median", "min", "max"),
                       left=("ratio",))
    for name, s in report["ratios"].items():
        itl = report["itl_ratios"][name]
        table.add_row(name, *[f"{v:.2f}x" for v in (s["median"], s["min"], s["max"],
                                                     itl["median"], itl["min"], itl["max"])])
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+",
                        default=["serve-float32", "serve-int8", "hf", "llamacpp-f32",
                                 "llamacpp-q8_0"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: every system samples plainly at this temperature")
    parser.add_argument("--requests", type=int, default=2,
                        help="requests per system per round (default 2)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "headline")
    parser.add_argument("--hf-venv", type=Path, default=HF_VENV)
    parser.add_argument("--llama-cpp-venv", type=Path, default=LLAMA_CPP_VENV)
    parser.add_argument("--output", type=Path, default=RESULTS / "one-stream.json")
    args = parser.parse_args(argv)

    machine = machine_info()
    console.print(machine_summary(machine))
    args.workdir.mkdir(parents=True, exist_ok=True)
    systems = start_systems(args.systems, args.workdir, args.hf_venv, args.llama_cpp_venv,
                            args.temperature)
    report = {"workload": {"model": "gpt2-small random", "prompt_tokens": PROMPT_LEN,
                           "new_tokens": NEW_TOKENS, "greedy": args.temperature == 0,
                           "temperature": args.temperature, "ignore_eos": True,
                           "requests_per_round": args.requests},
              "machine": machine, "rounds": {s.name: [] for s in systems}}
    try:
        for system in systems:
            console.print(f"starting {system.name} ...")
            system.ready()
        # idle servers take no CPU, so the read rate is measured with all of them up
        machine["read_bandwidth_start"] = read_bandwidth(reps=5)
        for r in range(args.rounds):
            for system in rotated(systems, r):
                run = system.measure(args.requests)
                if isinstance(system, OpenAISystem):
                    run["itl_ms"] = system.itl_ms()
                report["rounds"][system.name].append(run)
            console.print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{s.name} {report['rounds'][s.name][-1]['tok_s']:.1f}" for s in systems))
        machine["read_bandwidth_end"] = read_bandwidth(reps=5)
    finally:
        for system in systems:
            system.stop()

    rounds = report["rounds"]
    report["tok_s"] = {name: spread([r["tok_s"] for r in runs]) for name, runs in rounds.items()}
    report["itl_ms"] = {name: spread([r["itl_ms"] for r in runs]) for name, runs in rounds.items()}
    report["ratios"] = round_ratios(rounds, "tok_s")
    report["itl_ratios"] = round_ratios(rounds, "itl_ms")
    print_tables(report, args)
    write_json(args.output, report)
    plot(report, args.output.with_suffix(".png"))
    console.print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
