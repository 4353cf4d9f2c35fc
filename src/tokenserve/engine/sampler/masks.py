"""What a row of logits may not pick, or must weigh down, before a draw: structured-output
token masks, the repetition, presence and frequency penalties, and what NaN and +inf logits
mean for a draw (a broken model's)."""

from __future__ import annotations

import numpy as np

from tokenserve.sampling import SamplingParams

_SPARSE_WORDS = 8  # masks with at most this many non-zero words (256 tokens) go token by token


def apply_token_masks(logits: np.ndarray, rows: list[int], masks: np.ndarray) -> None:
    """Sets every token a row's mask does not allow to -inf, in place.

    Args:
        logits: float [S, vocab].
        rows: the rows of `logits` the masks are for.
        masks: int32 [len(rows), ceil(vocab / 32)]; bit t of a row (little-endian) allows
            token t.
    """
    words = masks.view(np.uint32)
    sparse = np.count_nonzero(words, axis=1) <= _SPARSE_WORDS
    if sparse.any():  # a forced token, a digit, a key: set the few allowed ones, not the vocab
        rows_sparse, words_sparse = np.asarray(rows)[sparse], words[sparse]
        mask_rows, word_ids = np.nonzero(words_sparse)
        bits = np.unpackbits(words_sparse[mask_rows, word_ids].view(np.uint8).reshape(-1, 4),
                             axis=1, bitorder="little")  # uint8 [set words, 32]
        set_words, bit_ids = np.nonzero(bits)
        token_rows = rows_sparse[mask_rows[set_words]]
        token_ids = word_ids[set_words] * 32 + bit_ids
        kept = logits[token_rows, token_ids]
        logits[rows_sparse] = -np.inf
        logits[token_rows, token_ids] = kept
    for row, mask in zip(np.asarray(rows)[~sparse], masks[~sparse]):
        allowed = np.unpackbits(mask.view(np.uint8), count=logits.shape[1], bitorder="little")
        np.copyto(logits[row], -np.inf, where=allowed == 0)


class Penalties:
    """One sequence's token counts, and the repetition, presence and frequency penalties
    they give its scores."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int]):
        self.params = params
        self.counts = np.zeros(vocab_size, np.int32)   # generated-token counts
        self.seen = np.zeros(vocab_size, bool)          # in the prompt or generated
        self.seen[np.asarray(prompt_ids, np.int64)] = True

    def observe(self, token_id: int) -> None:
        self.counts[token_id] += 1
        self.seen[token_id] = True

    def apply(self, scores: np.ndarray) -> np.ndarray:
        """scores: float32 [vocab], penalized in place (and returned)."""
        p = self.params
        if p.repetition_penalty != 1.0:
            hit = self.seen
            scores[hit] = np.where(scores[hit] > 0, scores[hit] / p.repetition_penalty,
                                   scores[hit] * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            # only the generated tokens: no vocabulary-sized temporaries
            hit = np.flatnonzero(self.counts)
            scores[hit] -= p.presence_penalty + p.frequency_penalty * self.counts[hit]
        return scores


def make_finite(scores: np.ndarray) -> None:
    """Replaces a row's non-finite scores, in place, with what they mean for a draw: a NaN is
    never drawn, the +inf tokens share all the mass equally, and a row with no finite score
    and no +inf one (all NaN or -inf) draws every token equally. A model that makes them is
    broken, but this row's draw stays defined, where the softmax would sum to NaN and the
    walk fail the whole step (every sequence in the batch)."""
    positive = np.isposinf(scores)
    if positive.any():
        scores[:] = np.where(positive, np.float32(0), np.float32(-np.inf))
        return
    scores[np.isnan(scores)] = -np.inf
    if scores.max() == -np.inf:
        scores[:] = 0


def is_nonfinite(score) -> bool:
    """A NaN or +inf logit: what no working model makes (-inf is a masked token)."""
    return bool(np.isnan(score) or score == np.inf)


def finite_argmax(scores: np.ndarray) -> int:
    """A greedy pick by the rules of a draw (make_finite): never a NaN, the first +inf if
    there is one, and token 0 where nothing is finite."""
    scores = np.array(scores, np.float32)
    make_finite(scores)
    return int(np.argmax(scores))
