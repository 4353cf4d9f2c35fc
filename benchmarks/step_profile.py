#!/usr/bin/env python
"""Where an engine step's time goes: Python around the step, the TF graph's ops, XLA.

Runs the in-process engine (LLMEngine, no server) on a GPT-2-small-shaped model with
random weights (32-token prompts, greedy, ignore_eos) at 1, 8 and 32 running sequences and
times each full-batch decode step in four parts:

  schedule    the scheduler's decision (plain Python)
  prepare     the runner turning it into index arrays (NumPy)
  tf step     the traced step: XLA dense programs, graph-mode attention and cache ops
  update      sampling, detokenizing, stop checks, stats (plain Python)

and, with TF's profiler over 20 more of those steps (not timed, and run on TF's default
executor: the profiler records no op of the single-threaded one the engine calls the step
on), splits the TF step's graph-mode ops by type (einsum, gathers, softmax, ...). Time not
covered by graph ops is XLA's dense code plus the executor's own overhead; `--dense-only`
times the dense XLA chain alone for comparison.

For a mixture of experts (--model an MoE export) each point also reports its expert load,
from the engine's own step stats: experts with rows per layer per step, and the busiest
expert's share of its layer's rows.

Results: a rich table on stdout and JSON in benchmarks/results/step_profile.json (or
--output), with the machine's CPU flags and ISA caps.

    python benchmarks/step_profile.py                        # float32 GPT-2-small
    python benchmarks/step_profile.py --model /path/to/int8/export
    # a packaged model, its steps through the fused dense ops against XLA's (0), alternating
    python benchmarks/step_profile.py --model gemma3 --fused-dense-tokens 0 32 --no-profile
    ONEDNN_MAX_CPU_ISA=AVX2 XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/step_profile.py
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import RESULTS, make_console, make_table, machine_info, machine_summary, write_json
from tokenserve.stats import StatsSink

console = make_console(140)


def export_preset(name: str, directory: Path) -> Path:
    from tokenserve.export.exporter import export_model
    from tokenserve.model.checkpoint import load_source

    model, tokenizer, config = load_source(name)
    return export_model(model, tokenizer, config, directory, jit_compile=False)


class Timed:
    """Wraps the engine's runner so each step's TF time (the step, then its LM head) is
    recorded in `tf_s`."""

    def __init__(self, runner):
        self.runner = runner
        self.tf_s = 0.0
        step = runner.step
        if hasattr(step, "step_function"):
            step.step_function = self._timing(step.step_function, restart=True)
            # the LM head, called after the step: its time adds on
            step.head_function = self._timing(step.head_function, restart=False)

    def _timing(self, make, restart: bool):
        """`make(*key)` -> a function, made to record each call's time (to its output's
        arrival as NumPy): the step's restarts `tf_s`, the head's adds to it."""
        def timed_make(*key, **options):
            fn = make(*key, **options)

            def call(*args):
                started = time.perf_counter()
                out = fn(*args)
                out.numpy()
                took = time.perf_counter() - started
                self.tf_s = took if restart else self.tf_s + took
                return out
            return call
        return timed_make


class ExpertLoad(StatsSink):
    """A stats sink keeping the last step's expert load (StepStats.expert_tokens: rows per
    expert per layer; empty for a model without experts)."""

    def __init__(self):
        self.last = ()

    def on_step(self, stats):
        self.last = stats.expert_tokens


def expert_summary(loads: list) -> dict | None:
    """Full decode steps' expert load: experts with rows per layer (mean), and the busiest
    expert's share of its layer's rows (median over steps and layers; 1/k is even)."""
    if not loads:
        return None
    loads = np.asarray(loads)                                       # [steps, layers, experts]
    return {"experts_with_rows_per_layer": float((loads > 0).sum(-1).mean()),
            "num_experts": int(loads.shape[-1]),
            "busiest_expert_share": float(np.median(loads.max(-1) / loads.sum(-1)))}


def profile_ops(logdir: str, num_steps: int) -> dict[str, float]:
    """Graph-mode op self time per step (ms) by op type, from the profiler's xplane."""
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin

    planes = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    data, _ = plugin.xspace_to_tools_data(planes[-1:], "framework_op_stats", {})
    table = json.loads(data)[0]
    columns = [c["id"] for c in table["cols"]]
    by_type: dict[str, float] = collections.defaultdict(float)
    for row in table["rows"]:
        values = dict(zip(columns, [c.get("v") for c in row["c"]]))
        if values["type"] != "IDLE":
            by_type[values["type"]] += values["total_self_time"] / 1e3 / num_steps
    return dict(sorted(by_type.items(), key=lambda kv: -kv[1]))


def run_point(engine, timed: Timed, num_seqs: int, max_tokens: int, profile: bool) -> dict:
    import tensorflow as tf

    from tokenserve.engine.step.flat_call import FlatCall
    from tokenserve.sampling import SamplingParams

    executor = FlatCall.EXECUTOR

    rng = np.random.default_rng(num_seqs)
    vocab = engine.config.model.vocab_size
    for _ in range(num_seqs):
        ids = [int(t) for t in rng.integers(0, vocab, 32)]
        engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=max_tokens,
                                                                   ignore_eos=True)))
    parts = collections.defaultdict(list)
    loads = []  # a mixture of experts' load of each timed full step
    logdir, profiled = tempfile.mkdtemp(prefix="step-profile-"), 0
    num_full = 0  # full-batch decode steps so far; 10-29 are profiled and not timed
    while engine.has_work:
        started = time.perf_counter()
        _, scheduled = engine.schedule()
        scheduled_at = time.perf_counter()
        full = (len(scheduled.scheduled) == num_seqs
                and all(s.num_new_tokens == 1 for s in scheduled.scheduled))
        tracing = profile and full and 10 <= num_full < 30
        num_full += full
        if tracing and profiled == 0:
            # TF's profiler sees no graph op run by the single-threaded executor the engine
            # uses (engine/step/flat_call.py), so the profiled steps run on the default one
            FlatCall.EXECUTOR = ""
            tf.profiler.experimental.start(logdir)
        output = engine.execute(scheduled)
        executed = time.perf_counter()
        engine.update(scheduled, output)
        updated = time.perf_counter()
        if tracing:
            profiled += 1
            if profiled == 20:
                tf.profiler.experimental.stop()
                FlatCall.EXECUTOR = executor
        if full and not tracing:
            parts["schedule"].append(scheduled_at - started)
            parts["prepare"].append(executed - scheduled_at - timed.tf_s)
            parts["tf"].append(timed.tf_s)
            parts["update"].append(updated - executed)
            if engine.stats.last:
                loads.append(engine.stats.last)
    if 0 < profiled < 20:
        tf.profiler.experimental.stop()
    FlatCall.EXECUTOR = executor
    medians = {k: float(np.median(v)) * 1e3 for k, v in parts.items()}
    medians["total"] = sum(medians.values())
    ops = profile_ops(logdir, profiled) if profiled else {}
    return {"num_seqs": num_seqs, "num_steps": len(parts["tf"]), "median_ms": medians,
            "graph_ops_ms": ops, "graph_ops_total_ms": sum(ops.values()),
            "expert_load": expert_summary(loads)}


def dense_only_ms(runner, num_tokens: int) -> float:
    """The XLA dense chain of one step alone (no attention, no cache ops)."""
    import tensorflow as tf

    step = runner.step
    if not getattr(step, "jit_dense", False):
        return float("nan")
    c = step.model.config
    weights, blocks = step.layer_weights, step.graph_blocks
    x = tf.random.normal([num_tokens, c.hidden_size])
    attn = tf.random.normal([num_tokens, c.num_heads * c.head_dim])  # Gemma's is wider
    positions = tf.zeros([num_tokens], tf.int32)

    @tf.function
    def chain(x):
        rotary = step.rotary(positions)
        q, k, v = blocks.enter(x, rotary, weights[0])
        for i in range(len(weights) - 1):
            x, q, k, v = blocks.between(x, attn, rotary, weights[i], weights[i + 1])
        return blocks.head(blocks.exit(x, attn, weights[-1]))

    chain(x).numpy()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        chain(x).numpy()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="exported model, or a packaged model's name (gemma3) "
                                        "(default: gpt2-small preset, random)")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--fused-dense-tokens", type=int, nargs="+", default=[None],
                        metavar="N", help="engines to compare, each running steps of up to N "
                        "tokens through the fused dense ops (0: XLA only); the default is the "
                        "engine's own choice")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the engines, alternating (medians over rounds)")
    parser.add_argument("--output", type=Path, default=RESULTS / "step_profile.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from tokenserve.engine.llm import LLM
    from tokenserve.engine.step.packing import bucket_size

    machine = machine_info()
    console.print(machine_summary(machine))
    model_dir = args.model or export_preset("gpt2-small", Path(tempfile.mkdtemp()) / "gpt2")
    if not Path(model_dir).is_dir():  # a packaged model's name: its cached export
        from tokenserve.export.cached_exports import packaged_export

        model_dir = packaged_export(model_dir)
    engines = {}
    for fused in args.fused_dense_tokens:
        options = {} if fused is None else {"max_fused_dense_tokens": fused}
        llm = LLM(model_dir, precision=args.precision, max_num_seqs=max(args.num_seqs),
                  **options)
        engine = llm.engine
        engine.stats = ExpertLoad()
        timed = Timed(engine.runner)
        engine.runner.compile_buckets()
        run_point(engine, timed, 1, 4, profile=False)  # trace the step graphs
        name = ("engine's choice" if fused is None else "XLA only" if fused == 0
                else f"fused up to {fused}")
        engines[name] = (engine, timed)
    rounds = {(name, n): [] for name in engines for n in args.num_seqs}
    for _ in range(args.repeats):  # alternating, so that the machine's load hits all alike
        for num_seqs in args.num_seqs:
            for name, (engine, timed) in engines.items():
                run_point(engine, timed, num_seqs, 4, profile=False)
                rounds[name, num_seqs].append(run_point(engine, timed, num_seqs,
                                                        args.max_tokens, args.profile))
    points = []
    for (name, num_seqs), runs in rounds.items():
        engine = engines[name][0]
        point = dict(runs[-1], engine=name, rounds=[r["median_ms"] for r in runs])
        point["median_ms"] = {k: float(np.median([r["median_ms"][k] for r in runs]))
                              for k in runs[0]["median_ms"]}
        point["dense_only_ms"] = dense_only_ms(
            engine.runner, bucket_size(num_seqs, engine.engine_config.batch_sizes, True, True))
        points.append(point)

    table = make_table(f"engine decode step, {Path(str(model_dir)).name} "
                       f"({engine.runner.precision}), median ms over {args.repeats} round(s)",
                       ("engine", "seqs", "schedule", "prepare", "tf step", "update", "total",
                        "tok/s", "XLA dense alone", "graph ops", "top graph ops"),
                       left=("engine", "top graph ops"))
    for p in points:
        m = p["median_ms"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(p["graph_ops_ms"].items())[:4])
        table.add_row(p["engine"], str(p["num_seqs"]), f"{m['schedule']:.2f}",
                      f"{m['prepare']:.2f}", f"{m['tf']:.2f}", f"{m['update']:.2f}",
                      f"{m['total']:.2f}", f"{p['num_seqs'] / m['total'] * 1e3:.1f}",
                      f"{p['dense_only_ms']:.2f}", f"{p['graph_ops_total_ms']:.2f}", top)
    console.print(table)
    if len(engines) > 1:  # each engine's step time against the first one's
        first = next(iter(engines))
        for p in points:
            base = next(q for q in points if q["engine"] == first
                        and q["num_seqs"] == p["num_seqs"])
            p["tf_step_ratio"] = p["median_ms"]["tf"] / base["median_ms"]["tf"]
            if p["engine"] != first:
                console.print(f"{p['engine']} vs {first}, {p['num_seqs']} seqs: tf step "
                              f"{p['tf_step_ratio']:.2f}x, total "
                              f"{p['median_ms']['total'] / base['median_ms']['total']:.2f}x")
    for p in points:  # a mixture of experts: how its rows spread over the experts
        if p["expert_load"]:
            e = p["expert_load"]
            console.print(f"{p['num_seqs']} seqs: {e['experts_with_rows_per_layer']:.2f} of "
                          f"{e['num_experts']} experts with rows per layer per step, the "
                          f"busiest taking {e['busiest_expert_share']:.0%} of its layer's rows")
    write_json(args.output, {
        "workload": {"model": str(model_dir), "precision": engine.runner.precision,
                     "prompt_tokens": 32, "max_tokens": args.max_tokens,
                     "engines": list(engines), "repeats": args.repeats},
        "machine": machine, "points": points})
    console.print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
