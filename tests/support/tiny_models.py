"""Tiny models built by our own code, with their own tiny tokenizer's text, and the
references that cached and served decoding are held to (full forward passes, no cache)."""

from __future__ import annotations

from tokenserve.config import GenerationConfig, preset

TINY_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for item in items:\n    if item is None:\n        continue\n    print(item)\n",
    "import os\nimport sys\n\nPATH = os.path.join('a', 'b')  # ünïcödé ✓\n",
] * 20
"""The tiny tokenizer's training text (the root conftest's `tokenizer` fixture)."""


def tiny(name: str, tokenizer, seed: int = 0):
    """(model, generation config) for a tiny preset, with random weights."""
    from tokenserve.model import build_model

    architecture = preset(name)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name=name)
    return build_model(architecture, seed=seed), config


def greedy_by_full_forward(model, prompt_ids, max_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes of the Keras model, no cache: the reference
    that cached and served decoding must equal."""
    import numpy as np

    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(np.argmax(model(np.asarray([ids], np.int32)).numpy()[0, -1])))
    return ids[len(prompt_ids):]


def reference_greedy(model, prompt_ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy decoding with full forward passes and no cache at all, ending at `eos`."""
    import numpy as np

    ids = list(prompt_ids)
    for _ in range(max_tokens):
        token = int(np.argmax(model(np.asarray([ids], np.int32)).numpy()[0, -1]))
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt_ids):]
