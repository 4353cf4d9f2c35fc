"""The remote KV tier: full blocks shared between replicas through a KV store. No TF.

A sequence that misses the local prefix cache looks up the following blocks of its hash
chain in the store, in one round trip on a worker thread, and waits in the tier (not in
the scheduler's queue) meanwhile, as vLLM's KV connectors do: steps of other sequences go
on. When the lookup returns, the scheduler gives it blocks for what was found and queues a
`KVLoad`, and the sequence prefills only the rest. Blocks are written to the store when a
sequence ends and when the LRU evicts them (a `KVSave`); the engine reads their rows from
the cache between steps and the worker sends them.

The store is anything with `get_blocks(hashes) -> list[bytes | None]` (one round trip) and
`put_blocks([(hash, payload)])`, both returning instead of raising when it is down (see
tokenserve.state.kv_store).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tokenserve.engine.request import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSave:
    """Read these blocks' rows and write them to the store under their hashes."""

    hashes: list[bytes]
    block_ids: list[int]


@dataclass(frozen=True)
class KVLoad:
    """Write these payloads (fetched from the store) into these blocks."""

    block_ids: list[int]
    payloads: list[bytes]


@dataclass
class _Lookup:
    seq: Sequence
    hashes: list[bytes]
    payloads: list[bytes] | None = None


class RemoteKVTier:
    """Lookups and writes of full KV blocks against a shared store, off the engine thread.

    Args:
        store: the KV store (tokenserve.state.kv_store.RedisKVStore).
        block_shape: shape of one block's rows as the runner reads them.
        dtype: the cache dtype (numpy).
        resave_after_s: a block saved or loaded this recently is not written again
            (half the store's TTL: a live block is refreshed before it expires).
    """

    def __init__(self, store, block_shape: tuple[int, ...], dtype, resave_after_s: float):
        self.store = store
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.resave_after_s = resave_after_s
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenserve-kv")
        self._lock = threading.Lock()
        self._pending: dict[int, _Lookup] = {}  # seq_id -> lookup in flight or done
        self._known: OrderedDict[bytes, float] = OrderedDict()  # hash -> when saved/loaded
        self.on_ready: Callable[[], None] = lambda: None
        """Called on the worker thread when a lookup completes (wakes the engine loop)."""
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_saved_blocks = 0

    @property
    def num_errors(self) -> int:
        return self.store.num_errors

    @property
    def num_loading(self) -> int:
        return len(self._pending)

    @property
    def has_finished(self) -> bool:
        """A lookup has returned and waits for the scheduler."""
        with self._lock:
            return any(lookup.payloads is not None for lookup in self._pending.values())

    def is_loading(self, seq: Sequence) -> bool:
        return seq.seq_id in self._pending

    # -- lookups --------------------------------------------------------------------------
    def start_lookup(self, seq: Sequence, hashes: list[bytes], block_size: int) -> None:
        """Looks up `hashes` (the blocks of `seq` after its local hits) on the worker."""
        lookup = _Lookup(seq, hashes)
        self._pending[seq.seq_id] = lookup
        self.num_query_tokens += len(hashes) * block_size
        self._pool.submit(self._fetch, lookup)

    def _fetch(self, lookup: _Lookup) -> None:
        try:
            found = self.store.get_blocks(lookup.hashes)
        except Exception:  # noqa: BLE001 - a store bug must not strand the sequence
            log.exception("KV store lookup failed")
            found = []
        payloads = []
        for payload in found:  # the chain's leading hits of the right size
            if payload is None or len(payload) != self.block_nbytes:
                break
            payloads.append(payload)
        with self._lock:
            lookup.payloads = payloads
        self.on_ready()

    def take_finished(self) -> list[tuple[Sequence, list[bytes], list[bytes]]]:
        """(sequence, hashes, payloads found) of every completed lookup, once each."""
        with self._lock:
            done = [lookup for lookup in self._pending.values() if lookup.payloads is not None]
        for lookup in done:
            del self._pending[lookup.seq.seq_id]
        return [(lookup.seq, lookup.hashes, lookup.payloads) for lookup in done]

    def cancel(self, seq: Sequence) -> None:
        """Forgets the lookup of a sequence that ended while it was in flight."""
        self._pending.pop(seq.seq_id, None)

    def count_hits(self, num_tokens: int) -> None:
        self.num_hit_tokens += num_tokens

    # -- saves ----------------------------------------------------------------------------
    def needs_save(self, hash_: bytes) -> bool:
        seen = self._known.get(hash_)
        return seen is None or time.monotonic() - seen > self.resave_after_s

    def _remember(self, hashes: list[bytes]) -> None:
        now = time.monotonic()
        for hash_ in hashes:
            self._known[hash_] = now
            self._known.move_to_end(hash_)
        while len(self._known) > 1 << 20:  # a bound, far above any cache's block count
            self._known.popitem(last=False)

    def apply(self, runner, transfers: list[KVSave | KVLoad]) -> None:
        """Runs queued transfers in order against the runner's cache (engine thread, between
        steps): a block evicted and then refilled is read before it is overwritten."""
        for transfer in transfers:
            if isinstance(transfer, KVLoad):
                rows = np.stack([np.frombuffer(p, self.dtype).reshape(self.block_shape)
                                 for p in transfer.payloads])
                runner.write_kv_blocks(transfer.block_ids, rows)
            else:
                rows = runner.read_kv_blocks(transfer.block_ids)     # [n, *block_shape]
                items = [(h, rows[i].tobytes()) for i, h in enumerate(transfer.hashes)]
                self._remember(transfer.hashes)
                self.num_saved_blocks += len(items)
                self._pool.submit(self.store.put_blocks, items)

    def loaded(self, hashes: list[bytes]) -> None:
        """Blocks just loaded from the store are there already: no need to write them."""
        self._remember(hashes)

    def close(self, wait: bool = False) -> None:
        """Stops the worker and closes the store; `wait` lets queued writes finish first."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.store.close()


def setup_prefix_cache(runner, engine_config, model_name: str, version: str
                       ) -> RemoteKVTier | None:
    """Names the runner's block hashes after the served model and opens the remote tier
    (with `engine_config.kv_store`); None when there is no tier."""
    from tokenserve.engine.prefix_cache import PrefixCachingAllocator, hash_namespace

    cache = runner.cache
    if not isinstance(cache, PrefixCachingAllocator):
        return None
    cache.namespace = hash_namespace(model_name, version, runner.config.model.weight_format,
                                     np.dtype(runner.kv_dtype).name)
    if engine_config.kv_store is None:
        return None
    from tokenserve.state.kv_store import RedisKVStore

    store = RedisKVStore(engine_config.kv_store, engine_config.kv_store_ttl_s,
                         engine_config.kv_store_timeout_s)
    return RemoteKVTier(store, runner.kv_block_shape, runner.kv_dtype,
                        resave_after_s=engine_config.kv_store_ttl_s / 2)
