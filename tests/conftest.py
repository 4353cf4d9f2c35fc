"""Shared fixtures: tiny models built by our own code, with their own tiny tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

from tokenserve.config import GenerationConfig, preset  # noqa: E402

TINY_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for item in items:\n    if item is None:\n        continue\n    print(item)\n",
    "import os\nimport sys\n\nPATH = os.path.join('a', 'b')  # ünïcödé ✓\n",
] * 20


def compiled_op_module(library):
    """The op module a kernels OpLibrary builds (cached across runs), or a skip of the
    calling test or fixture naming why it is unavailable (the fallback tests still run)."""
    loaded = library.load()
    if isinstance(loaded, str):
        pytest.skip(f"compiled {library.what} unavailable ({loaded}); the fallback tests run")
    return loaded[0]


def use_compiled_op(monkeypatch, library) -> None:
    """Clears the variables that would force `library`'s ops onto their fallback."""
    from tokenserve.kernels.build import KERNELS_ENV

    monkeypatch.delenv(library.mode_env, raising=False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)


def greedy_by_full_forward(model, prompt_ids, max_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes of the Keras model, no cache: the reference
    that cached and served decoding must equal."""
    import numpy as np

    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(np.argmax(model(np.asarray([ids], np.int32)).numpy()[0, -1])))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="session")
def tokenizer():
    from tokenserve.model.tokenizer import Tokenizer

    return Tokenizer.train(TINY_TEXT, vocab_size=400)


def tiny(name: str, tokenizer, seed: int = 0):
    """(model, generation config) for a tiny preset, with random weights."""
    from tokenserve.model import build_model

    architecture = preset(name)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name=name)
    return build_model(architecture, seed=seed), config


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
