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
    windows = holdout_windows(holdout_stream, 256, 8)
    ppl = perplexity(model, windows)
    # Uniform guessing is perplexity 8192; the report records the full held-out figure.
    reported = json.loads((BUILTIN_DIR / "train_report.json").read_text())
    assert ppl < 100, ppl
    assert math.isclose(math.log(ppl), math.log(reported["models"][family]["holdout_perplexity"]),
                        abs_tol=0.35)


def test_builtin_transformer_writes_an_indented_function_body():
    model, tokenizer, config = load_source("builtin")
    ids = tokenizer.encode("def read_config(path):\n")
    for _ in range(24):
        ids.append(int(np.argmax(model(np.array([ids], np.int32)).numpy()[0, -1])))
    text = tokenizer.decode(ids)
    body = text.split("\n", 1)[1]
    assert body.startswith("    "), text  # the model indents the function body
