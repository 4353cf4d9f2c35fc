"""KV-cache accounting: which cache blocks (or LSTM state slots) each sequence owns. No TF.

The runner's cache is a pool of `num_blocks * block_size` rows; a sequence's position p
lives in row `block_ids[p // block_size] * block_size + p % block_size`. Block 0 is never
handed out: padded gather indices point at it, so padding never reads a live sequence.
"""

from __future__ import annotations

from tokenserve.engine.request import Sequence


class BlockAllocator:
    """Hands out fixed-size KV-cache blocks; a sequence grows one block at a time."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3 ...

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Gives `seq` room for `num_new_tokens` more positions; False (and no change) if full."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        seq.block_ids.extend(self._free.pop() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_ids))
        seq.block_ids = []

    # -- prefix caching hooks: no-ops here (engine/prefix_cache.py implements them) ---------
    def match_prefix(self, seq: Sequence) -> int:
        """Gives a fresh `seq` the cached blocks of its longest cached prefix; returns how
        many tokens they hold (their prefill is skipped)."""
        return 0

    def cache_computed(self, seq: Sequence) -> None:
        """Makes the full, computed blocks of `seq` findable by later requests."""

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts an admitted sequence's prompt tokens and how many were cached."""

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no sequence uses; returns how many."""
        return 0


class SlotAllocator(BlockAllocator):
    """One recurrent-state slot per sequence (the LSTM family): a block so large that one
    holds any length, so a sequence takes a slot when it starts and never needs another."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots + 1, block_size=1 << 30)  # slot 0 is reserved, as block 0
