"""The CLI as a user runs it: streaming output, and one-line errors for bad input."""

import os
import shutil
import subprocess
import sys

import pytest

from tokenserve.export.exporter import export_model
from support.tiny_models import tiny


def tokenserve(*args, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "tokenserve", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    model, config = tiny("tiny-llama", tokenizer)
    base = tmp_path_factory.mktemp("cli-model")
    export_model(model, tokenizer, config, base)
    return base


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_generate_streams_a_completion(model_dir):
    result = tokenserve("generate", "def add(a, b):", "--model", str(model_dir),
                        "--max-tokens", "8", "--stats")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add(a, b):")
    assert "8 generated" in result.stderr


def test_generate_is_reproducible_with_a_seed(model_dir):
    args = ["generate", "x =", "--model", str(model_dir), "--max-tokens", "12",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "5"]
    first, second = tokenserve(*args), tokenserve(*args)
    assert first.returncode == 0 and first.stdout == second.stdout


def test_unknown_preset(tmp_path):
    assert_one_line_error(tokenserve("export", "gpt7-huge", "--output", str(tmp_path)),
                          "unknown model source 'gpt7-huge'", "gpt2-small")


@pytest.mark.parametrize("command", [["export", "tiny-gpt2"], ["prune", "builtin"],
                                     ["optimize", "builtin"], ["train"]])
@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_an_output_that_cannot_be_a_directory_is_one_line(tmp_path, command, where):
    """Checked before any slow work: the first write used to end in a traceback
    (NotADirectoryError) after the model had loaded."""
    taken = tmp_path / "taken"
    taken.write_text("x")
    output = taken if where == "file" else taken / "base"
    result = tokenserve(*command, "--output", str(output))
    assert_one_line_error(result, f"tokenserve {command[0]}: error:", str(output))
    assert taken.read_text() == "x"


def test_missing_model_directory(tmp_path):
    assert_one_line_error(tokenserve("generate", "x", "--model", str(tmp_path / "nope")),
                          "does not exist")


def test_corrupt_saved_model(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "1" / "saved_model.pb").write_bytes(b"\x08\x01garbage" * 10)
    assert_one_line_error(tokenserve("generate", "x", "--model", str(broken)),
                          "cannot load model from")


def test_prompt_longer_than_the_context(model_dir):
    result = tokenserve("generate", "word " * 300, "--model", str(model_dir))
    assert_one_line_error(result, "exceeds the model's context length of 128 tokens")


def test_absurd_sampling_parameter(model_dir):
    assert_one_line_error(tokenserve("generate", "x", "--model", str(model_dir),
                                     "--top-p", "7"), "top_p must be in (0, 1]")


def test_a_closed_pipe_ends_generate_quietly(model_dir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        f"{sys.executable} -m tokenserve generate 'def add(a, b):' --model {model_dir} "
        "--max-tokens 64 | head -c 1", shell=True, capture_output=True, text=True, env=env,
        timeout=300)
    assert result.stdout == "d"
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
