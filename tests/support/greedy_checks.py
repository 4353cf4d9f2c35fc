"""Greedy text held to a reference model's own choices on the same text (teacher-forced:
one forward pass over prompt + tokens), where exact equality is not the invariant: a model
that computes through quantized weights or activations against its dequantized float32
import, whose texts may part at a near-tie."""

from __future__ import annotations

import numpy as np


def forced_logits(reference, prompt_ids, tokens) -> np.ndarray:
    """The reference's logits [len(tokens), vocab] at each generated token's position: row i
    is its prediction for tokens[i], given the prompt and tokens[:i]."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in tokens]
    return reference(np.asarray([ids], np.int32)).numpy()[0, len(prompt_ids) - 1:-1]


def assert_greedy_up_to_near_ties(reference, prompt_ids, tokens, tolerance: float) -> None:
    """Each of `tokens` is the reference's greedy choice at its step, or short of that
    choice's logit by at most `tolerance` times the largest |logit| (a near-tie, within the
    error bound of the model's logits)."""
    logits = forced_logits(reference, prompt_ids, tokens)
    gaps = logits.max(-1) - logits[np.arange(len(tokens)), tokens]
    assert np.all(gaps <= tolerance * np.abs(logits).max()), gaps


def assert_greedy_agreement(reference, prompt_ids, tokens, min_share: float = 0.95,
                            first: int = 4) -> None:
    """The reference's greedy choice at each of `tokens`' steps, as `tokenserve eval`
    measures greedy agreement: at least `min_share` of them are the token generated, and
    the `first` ones all are."""
    choices = forced_logits(reference, prompt_ids, tokens).argmax(-1)
    assert np.mean(choices == np.asarray(tokens)) >= min_share
    assert list(choices[:first]) == list(tokens[:first])
