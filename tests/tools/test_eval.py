"""`tokenserve eval`: perplexity of an exported model, loaded as the engine loads it."""

import json
import subprocess
import sys

import numpy as np
import pytest

from support.tiny_models import TINY_TEXT, tiny
from tokenserve.cli.main import main
from tokenserve.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from tokenserve.tools import evaluate
from tokenserve.train.corpus import token_stream

# one exported tiny Transformer (the session fixture of conftest.py, this family only)
tiny_llama = pytest.mark.parametrize("exported", ["tiny-llama"], indirect=True)


def numpy_perplexity(model, windows):
    """exp(mean next-token NLL), from the model's eager logits with NumPy only."""
    logits = model(windows[:, :-1]).numpy().astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    targets = windows[:, 1:]
    picked = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return float(np.exp(-picked.mean())), targets.size


def test_windows_cover_the_token_stream(tokenizer):
    stream = token_stream(TINY_TEXT, tokenizer)
    windows = evaluate.text_windows(TINY_TEXT, tokenizer, context=16, max_tokens=10**9)
    assert windows.dtype == np.int32 and windows.shape[1] == 17
    # non-overlapping: each window starts on the token the previous one ended with
    assert (windows[1:, 0] == windows[:-1, -1]).all()
    scored = windows[:, 1:].ravel()
    np.testing.assert_array_equal(scored, stream[1:1 + len(scored)])
    assert len(stream) - 1 - len(scored) < 16

    capped = evaluate.text_windows(TINY_TEXT, tokenizer, context=16, max_tokens=64)
    assert capped.shape == (4, 17)
    assert capped[-1, -1] == windows[-1, -1]  # spread over the stream, not just its start
    assert evaluate.text_windows(TINY_TEXT, tokenizer, 16, max_tokens=5).shape == (1, 6)


@tiny_llama
def test_perplexity_matches_numpy_on_the_exported_model(exported):
    original, config, version_dir = exported
    model, tokenizer, loaded_config, resolved = evaluate.load_for_eval(version_dir.parent)
    assert resolved == version_dir and loaded_config == config
    windows = evaluate.text_windows(TINY_TEXT, tokenizer, context=24, max_tokens=5 * 24)
    assert windows.shape == (5, 25)
    expected, count = numpy_perplexity(original, windows)  # the weights before export
    result = evaluate.perplexity(model, windows, batch_size=2)  # a padded last batch
    assert result.num_tokens == count == 5 * 24
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.nll == pytest.approx(np.log(expected), rel=1e-4)
    assert result.reference_perplexity is None and result.greedy_agreement is None


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-lstm"])
def test_perplexity_matches_numpy_for_each_family(name, tokenizer):
    model, _ = tiny(name, tokenizer)
    windows = evaluate.text_windows(TINY_TEXT, tokenizer, context=20, max_tokens=60)
    expected, _ = numpy_perplexity(model, windows)
    assert evaluate.perplexity(model, windows, batch_size=8).perplexity == pytest.approx(
        expected, rel=1e-4)


@tiny_llama
def test_reference_agreement(exported, tokenizer):
    model, _, version_dir = exported
    windows = evaluate.text_windows(TINY_TEXT, tokenizer, context=32, max_tokens=4 * 32)
    same = evaluate.perplexity(model, windows, reference=model)
    assert same.delta_percent == 0.0 and same.greedy_agreement == 1.0
    assert same.reference_perplexity == same.perplexity

    other, _ = tiny("tiny-llama", tokenizer, seed=1)
    differs = evaluate.perplexity(model, windows, batch_size=3, reference=other)
    assert differs.greedy_agreement < 0.5
    assert differs.delta_percent == pytest.approx(
        100 * (differs.perplexity / differs.reference_perplexity - 1))
    assert differs.perplexity == pytest.approx(same.perplexity, rel=1e-5)


def test_builtin_models_held_out_perplexity():
    # Full split at the trainer's 256 tokens: 45.8 (Transformer), 158 (LSTM), as in
    # builtin/train_report.json; these 8192 tokens at 512: 45.7 and 140. Random weights: >8000.
    for word, bound in (("builtin", 70), ("builtin-lstm", 250)):
        model, tokenizer, config, _ = evaluate.load_for_eval(word)
        windows = evaluate.heldout_windows(tokenizer, config.max_seq_len, max_tokens=8192)
        assert windows.shape == (16, config.max_seq_len + 1)
        result = evaluate.perplexity(model, windows)
        assert result.num_tokens == 8192
        assert 1.0 < result.perplexity < bound, (word, result)


def test_cli_builtin_with_json(tmp_path, capsys):
    path = tmp_path / "eval.json"
    assert main(["eval", "builtin", "--max-tokens", "2048", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "scored 2,048 tokens in 4 windows of 512" in out
    record = json.loads(path.read_text())
    assert record["tokens"] == 2048 and record["context"] == 512
    assert record["perplexity"] == pytest.approx(np.exp(record["nll"]))
    assert 1.0 < record["perplexity"] < 100
    assert record["model"].endswith("/1") and "weight_format" in record
    assert record["precision"] == "float32"
    assert f"{record['perplexity']:.3f}" in out


@tiny_llama
def test_cli_data_files_and_reference(exported, tmp_path, capsys):
    _, _, version_dir = exported
    data = tmp_path / "code.py"
    data.write_text("".join(TINY_TEXT[:8]), encoding="utf-8")
    path = tmp_path / "eval.json"
    args = ["eval", str(version_dir), "--data", str(data), "--data", str(data),
            "--reference", str(version_dir.parent), "--context", "16", "--batch-size", "3",
            "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Δ perplexity +0.00 %  greedy agreement 100.0 %" in out
    record = json.loads(path.read_text())
    assert record["context"] == 16 and record["delta_percent"] == 0.0
    assert record["greedy_agreement"] == 1.0
    assert record["reference_perplexity"] == record["perplexity"]
    assert record["data"] == f"{data}, {data}"


@tiny_llama
def test_cli_errors(exported, tmp_path, capsys):
    _, _, version_dir = exported
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        (["eval", str(tmp_path / "nope")], "does not exist"),
        (["eval", str(version_dir), "--data", str(empty)], "no text to score"),
        (["eval", str(version_dir), "--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["eval", str(version_dir), "--context", "4096"], "exceeds the context length of 128"),
        (["eval", str(version_dir), "--max-tokens", "0"], "--max-tokens must be positive"),
        (["eval", str(version_dir), "--reference", "builtin"], "different tokenizer"),
    ]
    for args, fragment in cases:
        assert main(args) == 2, args
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert err and err[-1].startswith("tokenserve eval: error:"), (args, err)
        assert fragment in err[-1], (args, err)


def test_library_errors(tmp_path, tokenizer):
    with pytest.raises(ModelNotFoundError):
        evaluate.load_for_eval(tmp_path / "nope")
    with pytest.raises(InvalidRequestError):
        evaluate.text_windows(["", " \n"], tokenizer, 16, 100)
    with pytest.raises(InvalidRequestError):
        evaluate.perplexity(None, np.zeros([0, 5], np.int32))
    model, _ = tiny("tiny-gpt2", tokenizer)
    with pytest.raises(ConfigError, match="context length"):
        evaluate.perplexity(model, np.zeros([1, 130], np.int32))
    with pytest.raises(ConfigError, match="precision"):
        evaluate.load_for_eval("builtin", precision="int4")


def test_help_does_not_import_tensorflow():
    code = ("import argparse, sys\n"
            "from tokenserve.cli import eval as command\n"
            "command.add_parser(argparse.ArgumentParser().add_subparsers())\n"
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_batch_is_bounded_by_the_logits_memory(tokenizer, monkeypatch):
    """A large vocabulary scores fewer windows at once (each window's float32 logits count
    against LOGITS_BUDGET_BYTES), with the same result."""
    model, _ = tiny("tiny-gpt2", tokenizer)
    windows = evaluate.text_windows(TINY_TEXT, tokenizer, context=20, max_tokens=60)
    expected = evaluate.perplexity(model, windows, batch_size=8).perplexity
    monkeypatch.setattr(evaluate, "LOGITS_BUDGET_BYTES", 2 * 20 * model.config.vocab_size * 4)
    shapes = []
    scorer = evaluate._scorer

    def recording(m):
        score = scorer(m)
        return lambda chunk: (shapes.append(chunk.shape), score(chunk))[1]

    monkeypatch.setattr(evaluate, "_scorer", recording)
    result = evaluate.perplexity(model, windows, batch_size=8)
    assert shapes and all(shape[0] == 2 for shape in shapes)
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
