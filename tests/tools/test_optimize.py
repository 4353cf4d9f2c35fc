"""`tokenserve optimize`: the perplexity gate and its report."""

from __future__ import annotations

import json
import math

import pytest

from tokenserve.tools.optimize import GATE_PERCENT, VariantResult, rejected, write_report


def test_gate_rejects_over_five_percent_and_nan():
    assert GATE_PERCENT == 5.0
    assert not rejected(-3.0) and not rejected(0.0) and not rejected(5.0)
    assert rejected(5.01) and rejected(80.0) and rejected(math.nan)


def _result(name, delta, fmt="savedmodel"):
    return VariantResult(name=name, format=fmt, path=f"models/{name}", size_bytes=1 << 20,
                         perplexity=10 * (1 + delta / 100), delta_percent=delta,
                         greedy_agreement=0.9, decode_tok_s=100.0, ttft_ms=5.0,
                         rejected=rejected(delta))


def test_report_shows_rejected_variants(tmp_path):
    results = [_result("fp32", 0.0), _result("tflite-int8", 12.5, "tflite"),
               _result("pruned-heads25-ft", 3.0)]
    write_report(results, tmp_path, "test", {"source": "tiny"})
    table = (tmp_path / "optimize.md").read_text()
    assert "| tflite-int8 |" in table and "**rejected**" in table
    assert table.count("accepted") == 2
    record = json.loads((tmp_path / "optimize.json").read_text())
    assert [v["rejected"] for v in record["variants"]] == [False, True, False]
    assert (tmp_path / "optimize.png").stat().st_size > 0


@pytest.mark.slow
def test_optimize_runs_on_a_tiny_model(tmp_path, capsys):
    from tokenserve.cli.main import main

    assert main(["optimize", "tiny-gpt2", "--output", str(tmp_path), "--eval-tokens", "256",
                 "--max-tokens", "8", "--finetune-steps", "2", "--calibration-windows", "4",
                 "--no-engine",
                 "--variants", "fp32,tflite-dynamic-int8,pruned-heads25,pruned-heads25-ft"]) == 0
    variants = json.loads((tmp_path / "optimize.json").read_text())["variants"]
    assert [v["name"] for v in variants] == ["fp32", "tflite-dynamic-int8", "pruned-heads25",
                                             "pruned-heads25-ft"]
    pruned, tuned = variants[2:]
    # both start from one pruning: the same heads removed, the fine-tune changes only values
    assert tuned["note"].startswith(pruned["note"])
    assert "2 distilled fine-tune steps" in tuned["note"]
    assert pruned["perplexity"] != tuned["perplexity"]

    # --reuse measures what the first run built instead of building it again
    built = {v["name"]: tmp_path / v["path"] for v in variants}
    stamps = {name: path.stat().st_mtime_ns for name, path in built.items()}
    assert main(["optimize", "tiny-gpt2", "--output", str(tmp_path), "--eval-tokens", "256",
                 "--max-tokens", "8", "--no-engine", "--reuse",
                 "--variants", "fp32,pruned-heads25-ft"]) == 0
    again = json.loads((tmp_path / "optimize.json").read_text())["variants"]
    assert [v["name"] for v in again] == ["fp32", "pruned-heads25-ft"]
    assert again[1]["note"] == tuned["note"]
    assert again[1]["perplexity"] == pytest.approx(tuned["perplexity"], rel=1e-5)
    assert {name: built[name].stat().st_mtime_ns for name in ("fp32", "pruned-heads25-ft")} \
        == {name: stamps[name] for name in ("fp32", "pruned-heads25-ft")}
    # ...and refuses another model's variants, with the reason
    assert main(["optimize", "tiny-llama", "--output", str(tmp_path), "--reuse", "--no-engine",
                 "--variants", "fp32"]) == 2
    assert "holds variants of 'tiny-gpt2', not of 'tiny-llama'" in capsys.readouterr().err
