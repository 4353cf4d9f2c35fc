"""Checking drafted tokens (speculative decoding): the token a sequence takes at each
drafted position, such that its output follows exactly the distribution it samples from."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tokenserve.engine.sampler.draw import SequenceSampler, greedy_batch
from tokenserve.engine.sampler.walk import pick_whole


def verify_draft(sampler: SequenceSampler, logits: np.ndarray, draft: int) -> int:
    """The token `sampler`'s sequence takes where `draft` was proposed: greedy, the model's
    own choice (the draft is kept when they agree); sampled, the draft with probability
    p(draft) under the sequence's distribution (temperature, top-k, top-p, min-p and
    penalties applied), else a token drawn from that distribution without the draft,
    renormalized. A draft proposed with certainty (an n-gram lookup) is the
    speculative-sampling rule's simplest case: the token follows exactly the distribution
    SequenceSampler.sample draws from, though from other random draws.

    logits: float [vocab], the row after the token before the draft."""
    p = sampler.params
    scores = sampler.scores(logits)
    if p.temperature == 0.0:
        return sampler.greedy(scores)
    candidates, probs = sampler.softmax(scores)
    if p.top_p < 1.0 or p.min_p > 0.0:
        candidates, probs = sampler.nucleus(candidates, probs)
    at = np.flatnonzero(candidates == draft)
    if at.size and sampler.rng.random() < probs[at[0]] / probs.sum(dtype=np.float64):
        return int(draft)
    probs[at] = 0.0  # (probs is this call's own array)
    if not probs.any():  # p(draft) was 1 within rounding: nothing else to draw
        return int(draft)
    return int(candidates[pick_whole(probs, sampler.rng.random())])


def verified_tokens(sampler: SequenceSampler, logits: np.ndarray, drafts: tuple[int, ...]
                    ) -> Iterator[tuple[int, bool]]:
    """(token, whether its logits held a NaN or +inf) at each drafted position, then after
    the last draft the sequence's own next token: up to len(drafts) + 1 of them, for the
    caller to stop taking at the first refused draft.

    Greedy, every row's choice in one argmax; otherwise row by row, each when the caller
    asks for it, so that penalties see the tokens the caller kept (observed) before.
    logits: float [len(drafts) + 1, vocab], row i after the step's token i."""
    if sampler.is_greedy:
        yield from zip(*greedy_batch(logits))
        return
    for i in range(len(drafts) + 1):
        token = (verify_draft(sampler, logits[i], drafts[i]) if i < len(drafts)
                 else sampler.sample(logits[i]))
        yield token, sampler.saw_nonfinite
