"""Automatic prefix caching: full KV blocks named by a chained hash of their tokens. No TF.

A full block's hash covers its own tokens and, through the previous block's hash, every
token before it. The chain starts from a namespace (model name, version, weight format and
cache dtype), so an int8 and a float32 export never share a block.

Blocks are reference-counted, so running sequences with a common prefix share its blocks.
When a block's last sharer ends, a block with a hash stays cached in an LRU of free blocks
until its room is needed; a new sequence starts with the blocks of its longest cached
prefix and computes only the rest. At least the last prompt token is always computed, so
the step that finishes the prompt has logits to sample from.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenserve.engine.cache_accounting import BlockAllocator
from tokenserve.engine.request import Sequence


def hash_namespace(model_name: str, version: str, weight_format: str, dtype: str) -> bytes:
    """The root of every block hash chain of one model export and cache dtype."""
    text = f"tokenserve-kv-v1\0{model_name}\0{version}\0{weight_format}\0{dtype}"
    return hashlib.sha256(text.encode()).digest()


def block_hash(previous: bytes, token_ids: list[int]) -> bytes:
    """The hash of one full block, chained to the previous block's hash (or the namespace)."""
    return hashlib.sha256(previous + np.asarray(token_ids, "<i4").tobytes()).digest()


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative counters of one engine's prefix cache, in tokens (as vLLM's)."""

    num_query_tokens: int
    """Prompt tokens of the sequences admitted (vllm:prefix_cache_queries)."""
    num_hit_tokens: int
    """Of those, tokens found in the local cache (vllm:prefix_cache_hits)."""
    num_remote_query_tokens: int = 0
    """Tokens looked up in the shared KV store after a local miss."""
    num_remote_hit_tokens: int = 0
    """Tokens loaded from the shared KV store."""
    num_remote_saved_blocks: int = 0
    """Blocks written to the shared KV store."""
    num_remote_errors: int = 0
    """Failed calls to the shared KV store (each one recomputed instead)."""


class PrefixCachingAllocator(BlockAllocator):
    """A BlockAllocator whose full blocks are shared by hash and cached after use.

    Args:
        num_blocks: blocks in the pool, the reserved block 0 included.
        block_size: positions per block.
        namespace: root of the hash chains (see `hash_namespace`); settable until the
            first request.

    Example:
        >>> cache = PrefixCachingAllocator(64, 16, hash_namespace("m", "1", "float", "float32"))
        >>> cache.match_prefix(seq)  # tokens of seq's prompt already in the cache
    """

    def __init__(self, num_blocks: int, block_size: int, namespace: bytes = b""):
        super().__init__(num_blocks, block_size)
        self.namespace = namespace
        self._num_refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unused: oldest first
        self._seq_hashes: dict[int, list[bytes]] = {}
        self.on_evict: Callable[[bytes, int], None] | None = None
        """Called with (hash, block id) when a cached block is taken for new tokens, before
        anything overwrites it (the remote tier saves it then)."""
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks of `seq` (memoized per sequence)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        size = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            hashes.append(block_hash(hashes[-1] if hashes else self._root(seq),
                                     seq.token_ids[start:start + size]))
        return hashes[:num_blocks]

    def _root(self, seq: Sequence) -> bytes:
        """The namespace, salted by the sequence's LoRA adapter (Request.cache_salt)."""
        salt = getattr(seq.request, "cache_salt", b"")
        return hashlib.sha256(self.namespace + salt).digest() if salt else self.namespace

    def num_cacheable_blocks(self, seq: Sequence) -> int:
        """Full blocks a fresh `seq` may take from a cache: its last token stays uncomputed."""
        return (seq.num_tokens - 1) // self.block_size

    def lookup(self, block_hash_: bytes) -> int | None:
        return self._block_of.get(block_hash_)

    # -- allocation -----------------------------------------------------------------------
    def _take(self) -> int:
        """A block for new tokens: a never-cached one first, else the least recently used."""
        if self._free:
            block = self._free.pop()
            self._note_taken()
        else:
            block, _ = self._lru.popitem(last=False)
            evicted = self._hash_of.pop(block)
            del self._block_of[evicted]
            if self.on_evict is not None:
                self.on_evict(evicted, block)
        self._num_refs[block] = 1
        return block

    def _share(self, block: int) -> None:
        if self._num_refs[block] == 0:
            del self._lru[block]
        self._num_refs[block] += 1

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        self.release_behind(seq)
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_ids.extend(self._take() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        self.cache_computed(seq)
        # tail blocks first: when room is needed, a prefix's last blocks go before its first
        self._give_back([block for block in reversed(seq.block_ids) if block])
        seq.block_ids = []
        self._seq_hashes.pop(seq.seq_id, None)

    def _before_release(self, seq: Sequence) -> None:
        self.cache_computed(seq)  # blocks left behind a window stay findable, exactly

    def _give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self._num_refs[block] -= 1
            if self._num_refs[block] > 0:
                continue
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    # -- prefix caching -------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        if seq.block_ids:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        hits = []
        for hash_ in self.block_hashes(seq, self.num_cacheable_blocks(seq)):
            block = self._block_of.get(hash_)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            self._share(block)
        seq.block_ids = hits
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no sequence uses (as vLLM's reset_prefix_cache): they
        go back to the free list unsaved. Returns how many. Blocks in use keep their hashes."""
        blocks = list(self._lru)
        for block in blocks:
            del self._block_of[self._hash_of.pop(block)]
        self._lru.clear()
        self._free.extend(blocks)
        return len(blocks)

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted sequence's prompt and its locally cached tokens."""
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_computed(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """Registers `seq`'s newly full blocks under their hashes; returns them as
        (hash, block id) pairs (the remote tier writes them out)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        new = []
        for block, hash_ in zip(seq.block_ids, self.block_hashes(seq, num_full)):
            if not block or block in self._hash_of or hash_ in self._block_of:
                continue  # released, cached already, or computed twice: the first copy stays
            self._hash_of[block], self._block_of[hash_] = hash_, block
            new.append((hash_, block))
        return new

    def adopt(self, seq: Sequence, hashes: list[bytes]) -> list[tuple[int, int]] | None:
        """Appends blocks for `hashes` (the next blocks of `seq`'s chain, fetched from the
        remote tier) to `seq`, registered under their hashes. A hash cached meanwhile is
        shared instead. Returns (index into hashes, block id) of the blocks to fill, or
        None (and no change) when there is no room."""
        if len(hashes) > self.num_free_blocks:
            return None
        to_fill = []
        for i, hash_ in enumerate(hashes):
            block = self._block_of.get(hash_)
            if block is not None:
                self._share(block)
            else:
                block = self._take()
                self._hash_of[block], self._block_of[hash_] = hash_, block
                to_fill.append((i, block))
            seq.block_ids.append(block)
        seq.num_computed_tokens = len(seq.block_ids) * self.block_size
        return to_fill
