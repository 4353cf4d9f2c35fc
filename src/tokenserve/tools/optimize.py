"""`tokenserve optimize`: every size/speed variant of one model, each measured and gated.

Variants: fp32, bf16 and int8-weight SavedModels; TFLite fp32, float16, dynamic-int8 and
int8 files (run through LiteRT); heads pruned 25 % with and without a brief fine-tune. For
each: file size, held-out perplexity and its change from fp32, greedy agreement with fp32,
batch-1 decode tok/s and time to first token (SavedModels through their prefill/decode
signatures, as `tokenserve generate` runs them; .tflite through LiteRT), and for SavedModels
the engine's batch-1 decode rate too. A variant whose perplexity rises more than the gate
(5 %) is marked rejected, not dropped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GATE_PERCENT = 5.0  # an optimized model may lose at most 5 % perplexity
VARIANTS = ("fp32", "bf16", "int8-weights", "tflite-fp32", "tflite-float16",
            "tflite-dynamic-int8", "tflite-int8", "pruned-heads25", "pruned-heads25-ft")


def rejected(delta_percent: float, gate_percent: float = GATE_PERCENT) -> bool:
    """The perplexity gate: True when perplexity rose more than `gate_percent`."""
    return not delta_percent <= gate_percent  # NaN (a broken variant) is rejected too


@dataclass
class VariantResult:
    name: str
    format: str
    path: str
    size_bytes: int
    perplexity: float
    delta_percent: float
    greedy_agreement: float
    decode_tok_s: float
    ttft_ms: float
    engine_tok_s: float | None = None
    rejected: bool = False
    note: str = ""


def dir_size(path: Path) -> int:
    """Bytes of a .tflite file, or of a SavedModel's graph and variables (not assets)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    files = [path / "saved_model.pb", *sorted((path / "variables").glob("*"))]
    return sum(f.stat().st_size for f in files if f.is_file())


def time_stream(model, prompt_ids: list[int], max_tokens: int, repeats: int = 2):
    """(decode tok/s, TTFT ms), best of `repeats` greedy runs of `max_tokens` tokens."""
    from tokenserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    list(model.stream(prompt_ids, params))  # warm: traces, allocations
    best_rate, best_ttft = 0.0, float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        first = None
        count = 0
        for _token in model.stream(prompt_ids, params):
            first = first or time.perf_counter()
            count += 1
        done = time.perf_counter()
        best_rate = max(best_rate, (count - 1) / max(done - first, 1e-9))
        best_ttft = min(best_ttft, 1000 * (first - started))
    return best_rate, best_ttft


def engine_rate(version_dir: Path, prompt_ids: list[int], max_tokens: int,
                precision: str = "float32") -> float:
    """Batch-1 tok/s through the engine (`tokenserve.LLM`), after a warm-up request."""
    from tokenserve import LLM
    from tokenserve.engine.config import EngineConfig
    from tokenserve.sampling import SamplingParams

    llm = LLM(version_dir, EngineConfig(precision=precision, max_num_seqs=4))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    best = float("inf")
    for attempt in range(4):  # the first two compile the buckets this request touches
        started = time.perf_counter()
        llm.generate([prompt_ids], params, use_tqdm=False)
        if attempt >= 2:
            best = min(best, time.perf_counter() - started)
    return max_tokens / best


class Optimizer:
    """Builds and measures the variants of one source model under `output`."""

    def __init__(self, source, output: Path, eval_tokens: int = 8192, max_tokens: int = 128,
                 finetune_steps: int = 300, heads: float = 0.25, calibration_windows: int = 32,
                 progress: bool = True,
                 variants=VARIANTS, engine: bool = True, reuse: bool = False):
        from tokenserve.tools.evaluate import load_float_source

        self.output = Path(output)
        self.models_dir = self.output / "models"
        self.model, self.tokenizer, self.config = load_float_source(source)
        self.source = source or "builtin"
        self.eval_tokens, self.max_tokens = eval_tokens, max_tokens
        self.finetune_steps, self.heads = finetune_steps, heads
        self.calibration_windows = calibration_windows
        self.progress, self.variants, self.engine = progress, variants, engine
        self.reuse = reuse
        self._streams = None
        self._pruning = None

    # -- data -------------------------------------------------------------------------------
    def streams(self):
        if self._streams is None:
            from tokenserve.train.finetune import training_streams

            self._streams = training_streams(self.tokenizer)
        return self._streams

    def windows(self) -> np.ndarray:
        from tokenserve.tools.evaluate import stream_windows

        context = min(self.config.max_seq_len, 256)
        return stream_windows(self.streams()[1], context, self.eval_tokens)

    def prompt_ids(self) -> list[int]:
        holdout = self.streams()[1]
        return [int(t) for t in holdout[:64]]

    # -- building ---------------------------------------------------------------------------
    def _export(self, name: str, model, config=None) -> Path:
        import shutil

        from tokenserve.export.exporter import export_model

        base = self.models_dir / name
        shutil.rmtree(base, ignore_errors=True)
        return export_model(model, self.tokenizer, config or self.config, base, version=1)

    def build(self, name: str) -> tuple[Path, str, str]:
        """(path, format, note) of variant `name`, exported under models/."""
        import shutil

        if name == "fp32":
            return self._export(name, self.model), "savedmodel", ""
        if name == "bf16":
            from tokenserve.export.restore import load_language_model

            model, *_ = load_language_model(self.models_dir / "fp32", precision="bfloat16")
            return self._export(name, model), "savedmodel", "bfloat16 weights and compute"
        if name == "int8-weights":
            from tokenserve.model.quantize import quantize_model

            model = quantize_model(self.model)
            config = dataclasses.replace(self.config, model=model.config)
            return self._export(name, model, config), "savedmodel", "int8 weights, per channel"
        if name.startswith("tflite-"):
            from tokenserve.edge.convert import TFLITE_FILE, TFLiteOptions, export_tflite

            quantize = {"fp32": "none"}.get(name[len("tflite-"):], name[len("tflite-"):])
            base = self.models_dir / name
            shutil.rmtree(base, ignore_errors=True)
            path = export_tflite(self.model, self.tokenizer, self.config, base,
                                 TFLiteOptions(quantize=quantize), version=1,
                                 progress=self.progress)
            return path / TFLITE_FILE, "tflite", f"LiteRT, XNNPACK, quantize={quantize}"
        if name.startswith("pruned-"):
            import tempfile

            from tokenserve.train.finetune import finetune

            pruned, note = self._pruned()
            if name.endswith("-ft"):
                with tempfile.TemporaryDirectory() as workdir:
                    finetune(pruned, self.streams()[0], self.streams()[1], self.finetune_steps,
                             workdir, teacher=self.model)
                note += f", {self.finetune_steps} distilled fine-tune steps"
            config = dataclasses.replace(self.config, model=pruned.config)
            return self._export(name, pruned, config), "savedmodel", note
        raise ValueError(f"unknown variant {name!r}")

    def _pruned(self):
        """(a fresh copy of the pruned model, note). Heads are scored once per run (a forward
        pass per KV group: the slow part on a large model); both pruned variants start from
        the same pruning, the fine-tuned one from a copy."""
        from tokenserve.model import build_model
        from tokenserve.model.prune import PruneConfig, prune_model
        from tokenserve.train.finetune import calibration_windows

        if self._pruning is None:
            # 256-token windows, 32 by default: ablation scores on 8k tokens picked better
            # heads to drop than on 2k (docs/optimize.md)
            windows = calibration_windows(self.streams()[0], self.calibration_windows,
                                          min(256, self.config.max_seq_len))
            pruned, report = prune_model(self.model, windows, PruneConfig(heads=self.heads),
                                         progress=self.progress)
            note = f"{report.parameters_after:,} of {report.parameters_before:,} parameters"
            self._pruning = ({w.path: w.numpy() for w in pruned.weights}, pruned.config, note)
        values, config, note = self._pruning
        copy = build_model(config, dtype=self.model.compute_dtype)
        for weight in copy.weights:
            weight.assign(values[weight.path])
        return copy, note

    # -- measuring --------------------------------------------------------------------------
    def _load(self, path: Path, fmt: str, precision: str):
        from tokenserve.tools.evaluate import load_for_eval

        model, *_ = load_for_eval(path, precision)
        return model

    def measure(self, name: str, path: Path, fmt: str, note: str, reference) -> VariantResult:
        from tokenserve.edge.runner import LiteRTModel
        from tokenserve.tools.evaluate import perplexity
        from tokenserve.tools.generate import ExportedModel

        precision = "bfloat16" if name == "bf16" else "float32"
        model = self._load(path, fmt, precision)
        result = perplexity(model, self.windows(), reference=reference, progress=self.progress)
        runner = LiteRTModel(path) if fmt == "tflite" else ExportedModel(path)
        rate, ttft = time_stream(runner, self.prompt_ids(), self.max_tokens)
        engine = None
        if self.engine and fmt == "savedmodel":
            engine = engine_rate(path, self.prompt_ids(), self.max_tokens, precision)
        delta = result.delta_percent if result.delta_percent is not None else 0.0
        return VariantResult(
            name=name, format=fmt, path=str(path.relative_to(self.output)),
            size_bytes=dir_size(path), perplexity=result.perplexity, delta_percent=delta,
            greedy_agreement=(result.greedy_agreement if result.greedy_agreement is not None
                              else 1.0),
            decode_tok_s=rate, ttft_ms=ttft, engine_tok_s=engine,
            rejected=rejected(delta), note=note)

    def _built(self) -> dict[str, tuple[Path, str, str]]:
        """name -> (path, format, note) of the variants an earlier run left in `output`, as its
        optimize.json lists them: measuring again skips the minutes of building."""
        report = self.output / "optimize.json"
        if not report.exists():
            return {}
        from tokenserve.errors import ConfigError

        earlier = json.loads(report.read_text())
        if earlier.get("source") != self.source:
            raise ConfigError(f"--reuse: {self.output} holds variants of "
                              f"{earlier.get('source')!r}, not of {self.source!r}")
        built = {}
        for entry in earlier["variants"]:
            path = self.output / entry["path"]
            if path.exists():
                built[entry["name"]] = (path, entry["format"], entry.get("note", ""))
        return built

    def run(self) -> list[VariantResult]:
        from tqdm import tqdm

        results, reference = [], None
        names = list(self.variants)
        if "fp32" in names:  # the reference comes first
            names.remove("fp32")
        names.insert(0, "fp32")
        built = self._built() if self.reuse else {}
        for name in tqdm(names, desc="optimize", unit="variant", disable=not self.progress):
            path, fmt, note = built.get(name) or self.build(name)
            results.append(self.measure(name, path, fmt, note, reference))
            if name == "fp32":
                reference = self._load(path, fmt, "float32")
        return results


def write_report(results: list[VariantResult], output: Path, title: str, meta: dict) -> None:
    """optimize.json, optimize.md and optimize.png (perplexity change against speed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output.mkdir(parents=True, exist_ok=True)
    fp32 = next((r for r in results if r.name == "fp32"), results[0])
    (output / "optimize.json").write_text(json.dumps(
        dict(meta, gate_percent=GATE_PERCENT, variants=[dataclasses.asdict(r) for r in results]),
        indent=2) + "\n")
    lines = [f"# {title}", "", f"Gate: perplexity at most +{GATE_PERCENT:g} % over fp32. "
             f"{meta.get('description', '')}", "",
             "| variant | size MiB | size vs fp32 | perplexity | Δ ppl | greedy agree | "
             "decode tok/s | TTFT ms | engine tok/s | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        engine = f"{r.engine_tok_s:.0f}" if r.engine_tok_s else "–"
        lines.append(
            f"| {r.name} | {r.size_bytes / 2**20:.1f} | {r.size_bytes / fp32.size_bytes:.0%} | "
            f"{r.perplexity:.3f} | {r.delta_percent:+.2f} % | {r.greedy_agreement:.1%} | "
            f"{r.decode_tok_s:.0f} | {r.ttft_ms:.0f} | {engine} | "
            f"{'**rejected**' if r.rejected else 'accepted'} |")
    (output / "optimize.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        color = "tab:red" if r.rejected else ("tab:blue" if r.format == "tflite" else "tab:green")
        ax.scatter(r.decode_tok_s, r.delta_percent, color=color, marker="x" if r.rejected else "o")
        # staggered: variants of one format often sit at about the same point
        ax.annotate(r.name, (r.decode_tok_s, r.delta_percent), fontsize=8,
                    xytext=(4, 4 + 10 * (i % 4)), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", color="0.6", linewidth=0.5))
    ax.margins(x=0.08, y=0.18)  # room for the staggered labels
    ax.axhline(GATE_PERCENT, color="tab:red", linestyle="--", linewidth=1, label="gate +5 %")
    ax.set_xlabel("batch-1 decode tok/s (SavedModel signatures or LiteRT)")
    ax.set_ylabel("held-out perplexity change vs fp32 (%)")
    ax.set_title(title)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(output / "optimize.png", dpi=120)
    plt.close(fig)


def print_table(results: list[VariantResult], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    fp32 = next((r for r in results if r.name == "fp32"), results[0])
    table = Table(title=title)
    for column in ("variant", "size MiB", "vs fp32", "perplexity", "Δ ppl", "greedy",
                   "decode tok/s", "TTFT ms", "engine tok/s", "verdict"):
        table.add_column(column, justify="left" if column in ("variant", "verdict") else "right")
    for r in results:
        table.add_row(r.name, f"{r.size_bytes / 2**20:.1f}",
                      f"{r.size_bytes / fp32.size_bytes:.0%}", f"{r.perplexity:.3f}",
                      f"{r.delta_percent:+.2f} %", f"{r.greedy_agreement:.1%}",
                      f"{r.decode_tok_s:.0f}", f"{r.ttft_ms:.0f}",
                      f"{r.engine_tok_s:.0f}" if r.engine_tok_s else "–",
                      "[red]rejected[/red]" if r.rejected else "[green]accepted[/green]")
    Console(width=140).print(table)
