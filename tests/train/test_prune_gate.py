"""`tokenserve prune`'s perplexity gate: a pruned model whose held-out perplexity rises past
`--max-perplexity-increase` is not exported, a fine-tuned one that stays within it is, and
`--force` exports past it with the figures in the export's assets.

The source is a tiny Llama trained here on a small corpus (`--data`), so pruning half its KV
groups costs it measurably (random weights would lose nothing to pruning)."""

from __future__ import annotations

import json
import math
import re

import pytest

from tokenserve.cli.main import build_parser, main
from tokenserve.errors import ConfigError
from tokenserve.train.prune_gate import GateConfig, GateResult

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for item in items:\n    if item is None:\n        continue\n    print(item)\n",
    "import os\nimport sys\n\nPATH = os.path.join('a', 'b')\n",
] * 20
SUMMARY = re.compile(r"held-out perplexity (\d+\.\d+) -> (\d+\.\d+) \(([+-]\d+\.\d+) %, limit "
                     r"\+5 %\) on [\d,]+ tokens of the last 10 % of --data")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(checkpoint json, --data file): a tiny Llama trained on CORPUS, saved as `tokenserve
    train` saves one."""
    from tokenserve.config import GenerationConfig, TrainConfig, preset
    from tokenserve.model import build_model
    from tokenserve.model.tokenizer import Tokenizer
    from tokenserve.model.weights import save_weights
    from tokenserve.train.corpus import token_stream
    from tokenserve.train.trainer import Trainer

    root = tmp_path_factory.mktemp("prune-gate")
    tokenizer = Tokenizer.train(CORPUS, vocab_size=400)
    architecture = preset("tiny-llama")
    model = build_model(architecture, seed=0)
    stream = token_stream(CORPUS, tokenizer)
    Trainer(model, TrainConfig(seq_len=32, batch_size=8, num_steps=80, learning_rate=3e-3,
                               warmup_steps=5, weight_decay=0.0, eval_batches=1,
                               precision="fp32"), root / "train").fit(stream, stream)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="tiny-llama")
    (root / "teacher.json").write_text(json.dumps(config.to_dict()))
    save_weights(model, root / "teacher.safetensors")
    tokenizer.save(root / "tokenizer.json")
    data = root / "code.py"
    data.write_text("".join(CORPUS))
    return root / "teacher.json", data


def _prune(source, output, *flags: str) -> int:
    checkpoint, data = source
    return main(["prune", str(checkpoint), "--output", str(output), "--heads", "0.5",
                 "--data", str(data), "--window", "32", "--calibration-windows", "8", *flags])


def _figures(stdout: str) -> tuple[float, float, float]:
    """(source perplexity, pruned perplexity, change in %) from the printed summary."""
    match = SUMMARY.search(stdout)
    assert match, stdout
    return float(match[1]), float(match[2]), float(match[3])


def _report(base) -> dict:
    (version,) = [path for path in base.iterdir() if path.name.isdigit()]
    assert (version / "saved_model.pb").is_file()
    return json.loads((version / "assets.extra" / "prune_report.json").read_text())


def test_a_prune_past_the_gate_is_refused_and_nothing_is_exported(source, tmp_path, capsys):
    output = tmp_path / "pruned"
    assert _prune(source, output) == 1
    captured = capsys.readouterr()
    before, after, change = _figures(captured.out)
    assert change > 5.0 and after > before
    assert (f"refused to export: the pruned model's held-out perplexity is {after:.3f} "
            f"against {before:.3f} before pruning ({change:+.2f} %), past the +5 % limit of "
            f"--max-perplexity-increase") in captured.err
    assert "--finetune-steps 300" in captured.err and "--force" in captured.err
    assert not output.exists()  # made for the export, removed with nothing in it


def test_a_fine_tuned_prune_passes_the_gate_and_is_exported(source, tmp_path, capsys):
    output = tmp_path / "pruned"
    assert _prune(source, output, "--finetune-steps", "10", "--learning-rate", "3e-3") == 0
    before, after, change = _figures(capsys.readouterr().out)
    assert change <= 5.0
    figures = _report(output)["perplexity"]
    assert figures["passed"] and not figures["forced"]
    assert (round(figures["source_perplexity"], 3), round(figures["pruned_perplexity"], 3)) == (
        before, after)


def test_force_exports_past_the_gate_and_records_the_figures(source, tmp_path, capsys):
    output = tmp_path / "pruned"
    assert _prune(source, output, "--force") == 0
    captured = capsys.readouterr()
    before, after, change = _figures(captured.out)
    assert change > 5.0
    assert "exported past the +5 % perplexity limit (--force)" in captured.err
    report = _report(output)
    figures = report["perplexity"]
    assert not figures["passed"] and figures["forced"]
    assert figures["max_increase_percent"] == 5.0
    assert (round(figures["source_perplexity"], 3), round(figures["pruned_perplexity"], 3),
            round(figures["delta_percent"], 2)) == (before, after, change)
    assert figures["held_out"] == "the last 10 % of --data" and figures["num_tokens"] > 0
    assert report["finetune_steps"] == 0


def _result(delta_percent: float, limit: float = 5.0) -> GateResult:
    return GateResult(source_perplexity=40.0, pruned_perplexity=40.0 * (1 + delta_percent / 100),
                      delta_percent=delta_percent, max_increase_percent=limit,
                      num_tokens=8192, num_windows=32, context=256,
                      held_out="the built-in held-out split")


def test_the_verdict_and_its_advice():
    assert _result(5.0).passed and _result(-3.0).passed
    assert not _result(5.01).passed and not _result(math.nan).passed  # a broken model fails
    assert _result(20.0, limit=25.0).passed
    assert "--finetune-steps 300" in _result(32.0).refusal(finetune_steps=0)
    assert "longer than --finetune-steps 40" in _result(9.0).refusal(finetune_steps=40)
    assert _result(6.0).to_dict()["passed"] is False


def test_the_limit_is_a_percentage_and_takes_tf_serving_style_spelling():
    for bad in (-1.0, math.nan):
        with pytest.raises(ConfigError, match="--max-perplexity-increase"):
            GateConfig(max_increase_percent=bad)
    with pytest.raises(ConfigError, match="--eval-tokens"):
        GateConfig(max_tokens=0)
    parse = build_parser().parse_args
    assert parse(["prune", "--output", "x"]).max_perplexity_increase == 5.0
    assert parse(["prune", "--output", "x", "--max_perplexity_increase", "2.5"]
                 ).max_perplexity_increase == 2.5
    assert not parse(["prune", "--output", "x"]).force
