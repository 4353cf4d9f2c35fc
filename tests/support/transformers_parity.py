"""An imported model's logits against its `transformers` reference: the full forward pass of
each prompt, and one right-padded batch through the model's cached step (in one chunk, or in
two split at a position). No tests here."""

from __future__ import annotations

import numpy as np


def assert_logits_match(reference, model, prompts, split: int | None = None,
                        atol: float = 1e-4) -> None:
    """Every prompt's logits (full forward) and each prompt's last-token logits from the
    cached step within `atol` of the transformers model `reference`'s. split: the cached step
    takes the first `split` positions, then the rest (prompts no longer than `split` are
    checked by the full forward only); None: the whole batch at once."""
    import torch

    expected = []
    for prompt in prompts:
        with torch.no_grad():
            expected.append(reference(torch.tensor([prompt])).logits.numpy()[0])
        got = model(np.array([prompt], np.int32)).numpy()[0]
        np.testing.assert_allclose(got, expected[-1], atol=atol, rtol=0)
    width = max(map(len, prompts))
    split = split or width
    lengths = np.array([len(p) for p in prompts], np.int32)
    batch = np.zeros([len(prompts), width], np.int32)
    for i, prompt in enumerate(prompts):
        batch[i, :len(prompt)] = prompt
    state = model.init_state(len(prompts), width)
    first = np.minimum(lengths, split)
    logits, state = model.step(batch[:, :split], state, np.zeros(len(prompts), np.int32), first)
    if split < width:
        logits, _ = model.step(batch[:, split:], state, first, np.maximum(lengths - split, 1))
    for i, prompt in enumerate(prompts):
        if len(prompt) > split or split == width:
            np.testing.assert_allclose(logits.numpy()[i], expected[i][-1], atol=atol, rtol=0)
