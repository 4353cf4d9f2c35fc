"""Sampling parameters and a NumPy sampler for token-by-token generation.

Plain Python and NumPy (no TensorFlow), so the engine can sample per request
with each request's own parameters and random stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; the defaults are greedy decoding of up to 128 tokens."""

    max_tokens: int = 128
    temperature: float = 0.0
    """0 is greedy (argmax); higher flattens the distribution."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    seed: int | None = None
    """Fixes the random stream, so the same request gives the same tokens."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 1_000_000:
            raise InvalidRequestError(f"max_tokens must be between 1 and 1000000, "
                                      f"got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    """Draws tokens from logits under one request's SamplingParams."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: float [vocab] -> the chosen token id."""
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        order = np.argsort(-scaled, kind="stable")
        if p.top_k > 0:
            order = order[:p.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            mass_before = np.cumsum(probs) - probs
            keep = mass_before < p.top_p
            order, probs = order[keep], probs[keep] / probs[keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
