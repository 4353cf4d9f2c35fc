"""The shipped built-in models: they load, they learned Python, and they export."""

import json
import math

import numpy as np
import pytest

from tokenserve.model.checkpoint import BUILTIN_DIR, load_source
from tokenserve.train.corpus import Corpus, token_stream
from tokenserve.train.trainer import holdout_windows, perplexity


@pytest.fixture(scope="module")
def holdout_stream():
    corpus = Corpus.from_stdlib(holdout_fraction=0.05)
    from tokenserve.model.tokenizer import Tokenizer

    return token_stream(corpus.holdout_texts, Tokenizer.load(BUILTIN_DIR / "tokenizer.json"))


def test_shipped_files_fit_the_size_budget():
    sizes = [p.stat().st_size for p in BUILTIN_DIR.glob("*.safetensors")]
    assert len(sizes) == 2 and sum(sizes) <= 32 * 2**20


@pytest.mark.parametrize("source,family", [("builtin", "transformer"),
                                           ("builtin-lstm", "lstm")])
def test_builtin_models_have_learned_python(source, family, holdout_stream):
    model, tokenizer, config = load_source(source)
    assert config.model.family == family and config.model.vocab_size == tokenizer.vocab_size
    # A uniform guess is perplexity 8192, and so is, nearly, an untrained model.
    assert perplexity(model, holdout_windows(holdout_stream, 256, 8)) < 250


@pytest.mark.slow
@pytest.mark.parametrize("source,family", [("builtin", "transformer"),
                                           ("builtin-lstm", "lstm")])
def test_shipped_weights_have_the_reported_perplexity(source, family, holdout_stream):
    model, _, _ = load_source(source)
    reported = json.loads((BUILTIN_DIR / "train_report.json").read_text())["models"][family]
    windows = holdout_windows(holdout_stream, 256, 10**9)
    assert len(windows) == reported["holdout_windows"]
    assert math.isclose(perplexity(model, windows), reported["holdout_perplexity"], rel_tol=1e-3)


def test_builtin_transformer_writes_an_indented_function_body():
    model, tokenizer, config = load_source("builtin")
    prompt = "def read_config(path):"
    ids = tokenizer.encode(prompt)
    for _ in range(24):
        ids.append(int(np.argmax(model(np.array([ids], np.int32)).numpy()[0, -1])))
    text = tokenizer.decode(ids)
    assert text.startswith(prompt)
    assert text[len(prompt):].startswith("\n    "), text  # a new line, then an indented body
