"""KV-cache accounting: which cache blocks (or LSTM state slots) each sequence owns. No TF.

The runner's cache is a pool of `num_blocks * block_size` rows; a sequence's position p
lives in row `block_ids[p // block_size] * block_size + p % block_size`. Block 0 is never
handed out: padded gather indices point at it, so padding never reads a live sequence.

With a `window` (a model whose every layer attends to at most its last W positions), a
growing sequence gives back the blocks all its layers have left behind: their entries in
`block_ids` become block 0, so the later blocks keep their positions, and the memory a
sequence holds stays flat however long it runs.
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
        self._min_free = len(self._free)  # the bottom ones were never handed out
        self.window = 0
        """Positions back that any layer reads (every layer windowed), 0: all of them. Set by
        the runner before the first request."""

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_blocks_written(self) -> int:
        """Blocks ever handed out, the padding block included: the pool rows a step may have
        written. Freed blocks go back on top of the free list and the never-used ones wait at
        its bottom in order, so these are always blocks 0 .. n-1, the pages a lazily paged
        pool (engine/step/kv_pool.py) holds resident."""
        return self.num_blocks - self._min_free

    def _note_taken(self) -> None:
        self._min_free = min(self._min_free, len(self._free))

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
        self.release_behind(seq)
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        seq.block_ids.extend(self._free.pop() for _ in range(needed))
        self._note_taken()
        return True

    def free(self, seq: Sequence) -> None:
        self._give_back([block for block in reversed(seq.block_ids) if block])
        seq.block_ids = []

    def release_behind(self, seq: Sequence) -> int:
        """Gives back the blocks of `seq` that lie wholly before its next query's window
        (none without a window); returns how many. Their entries become block 0. The next
        query is at num_computed_tokens, which never moves back while `seq` holds blocks
        (rejected drafts roll back only past it), so a released block is never read again."""
        if not self.window:
            return 0
        first_needed = seq.num_computed_tokens - self.window + 1
        num_behind = min(max(first_needed, 0) // self.block_size, len(seq.block_ids))
        released = [block for block in seq.block_ids[:num_behind] if block]
        if released:
            self._before_release(seq)
            seq.block_ids[:num_behind] = [0] * num_behind
            self._give_back(released[::-1])
        return len(released)

    def _before_release(self, seq: Sequence) -> None:
        """Hook: the prefix cache registers the blocks' hashes first."""

    def _give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

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
