"""Fixtures every folder shares: the tiny tokenizer, and tiny models of each family built by
our own code and exported once per session. A folder's own fixtures are in its conftest;
helpers (not fixtures) are in tests/support/."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

from support.tiny_models import TINY_TEXT, tiny  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from tokenserve.model.tokenizer import Tokenizer

    return Tokenizer.train(TINY_TEXT, vocab_size=400)


@pytest.fixture(scope="session", params=["tiny-gpt2", "tiny-llama", "tiny-lstm"])
def exported(request, tokenizer, tmp_path_factory):
    """(in-memory model, config, version dir) for each family, exported with XLA."""
    from tokenserve.export.exporter import export_model

    model, config = tiny(request.param, tokenizer)
    base = tmp_path_factory.mktemp(request.param)
    return model, config, export_model(model, tokenizer, config, base)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tokenizer, tmp_path_factory):
    """A tiny GPT-2 exported once for the session (read-only: engines load it)."""
    from tokenserve.export.exporter import export_model

    model, config = tiny("tiny-gpt2", tokenizer)
    return export_model(model, tokenizer, config, tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory) -> dict:
    """A tiny embedder (mean pooling, normalized) and a tiny cross-encoder, written by
    transformers and exported once for the session: {"embed": base path, "rerank": base
    path, "embed-hf"/"rerank-hf": their transformers folders} (read-only)."""
    from support.tiny_encoders import export_tiny_encoders

    base = tmp_path_factory.mktemp("tiny-encoders")
    paths = export_tiny_encoders(base)
    return {**paths, "embed-hf": base / "embed-hf", "rerank-hf": base / "rerank-hf"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """`@pytest.mark.slow_cases(imported=["a", "b"])` marks slow only the cases of a test
    whose parametrized fixture (or parameter) `imported` is "a" or "b": the default run keeps
    the other cases, which check the same invariant on a model of another shape. Runs before
    `-m 'not slow'` deselects."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        for mark in item.iter_markers("slow_cases"):
            if callspec and any(callspec.params.get(name) in values
                                for name, values in mark.kwargs.items()):
                item.add_marker(pytest.mark.slow)
