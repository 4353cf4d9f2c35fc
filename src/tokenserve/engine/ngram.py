"""N-gram drafts for speculative decoding ("prompt lookup"): the tokens that followed the
sequence's current tail the first time that tail appeared in it.

A batch-1 float32 step reads every weight once whatever the number of tokens it computes
(docs/performance.md: GPT-2-small's step runs at the machine's memory read rate), so
checking a few drafted tokens in one step costs little more than computing one. Text that
repeats itself (code being edited, a document being summarized or quoted, structured
output, a model stuck in a loop) then comes out several tokens per step. With greedy
sampling the output is exactly the same tokens as without drafts; sampled output keeps its
distribution (SequenceSampler.verify; tests/engine/test_speculative.py).

Plain Python, no TF: the index is a dict from n-gram to where it first ended, kept up to
date as tokens are appended, so a proposal costs O(max_n) whatever the sequence's length.
"""

from __future__ import annotations


class NgramDrafter:
    """Proposes up to `num_tokens` drafts from the sequence's own earlier text.

    The longest tail of `max_n` down to `min_n` tokens that occurred before wins; the draft
    is what followed its first occurrence (the first one leaves the most tokens to copy
    where the text loops).

    How many it proposes adapts to how many the model kept (`observe`), as transformers'
    assisted generation does: two more after a check that kept them all, one fewer (at least
    one) after one that did not. A step checking drafts costs more the more it checks
    (GPT-2-small on a 2-core AVX2-only EPYC: 1.1x a plain step for one draft, 1.1-1.2x for
    two, 1.3-1.5x for four), so text the drafts do not predict falls back to cheap checks.

    Example:
        >>> drafter = NgramDrafter(num_tokens=3, min_n=1, max_n=2)
        >>> drafter.propose([5, 6, 7, 8, 5, 6])
        [7, 8, 5]
    """

    def __init__(self, num_tokens: int, min_n: int = 1, max_n: int = 3):
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need num_tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{num_tokens}, {min_n}, {max_n}")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.length = num_tokens
        """How many drafts the next proposal may have (adapted by observe)."""
        self._first_end: dict[tuple[int, ...], int] = {}
        """n-gram -> the index just after its first occurrence (where its follower is)."""
        self._num_indexed = 0  # tokens whose followers are indexed: n-grams ending before it

    def _index(self, tokens: list[int]) -> None:
        # an n-gram is indexed once the token after it exists: the tail itself never matches
        first_end = self._first_end
        for end in range(max(self._num_indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_end.setdefault(tuple(tokens[end - n:end]), end)
        self._num_indexed = max(self._num_indexed, len(tokens))

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) tokens to check after `tokens` (the sequence so far:
        the same list, grown, on every call); [] when its tail never occurred before."""
        limit = self.length if limit is None else min(limit, self.length)
        if limit < 1:
            return []
        self._index(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._first_end.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """The outcome of checking a proposal: adapts the next ones' length."""
        if num_drafted and num_accepted == num_drafted:
            self.length = min(self.num_tokens, self.length + 2)
        elif num_drafted:
            self.length = max(1, self.length - 1)
