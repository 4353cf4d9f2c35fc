"""The remote KV tier: full blocks shared between replicas through a KV store. No TF.

A sequence is looked up when it arrives: the blocks of its hash chain after the local
cache's leading hits, in one round trip on a worker thread, while it waits in the queue. If
it reaches the head of the queue before the answer, it waits in the tier (not in the queue)
as vLLM's KV connectors do: steps of other sequences go on. When the answer is there, the
scheduler gives it blocks for what was found and queues a `KVLoad` (rows already gathered
into one array of the cache dtype on the worker), and the sequence prefills only the rest.

A lookup that answers while the engine is idle and other lookups are still in flight
waits for them up to `gather_s` (a timer wakes the engine then): a turn's requests arrive
together when the replica that answered the previous turn ends them together, and a first
step run for the first answer alone would hold up all the others by a full prefill step.

A block is written to the store as soon as it is full (a `KVSave` queued when the block is
cached), so a conversation continued on another replica finds all but, at most, the blocks
filled by its last step; those are written when the sequence ends, before its last output
goes out. Evicted blocks the store may lack are written too. The engine gathers the rows
between steps (a block never changes once full); a writer thread serializes and sends them,
in the order they were queued.

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
from dataclasses import dataclass, field

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
    """Write these rows (fetched from the store) into these blocks."""

    block_ids: list[int]
    rows: np.ndarray
    """[len(block_ids), *block_shape], in the cache dtype."""


@dataclass
class RemoteLookup:
    """One sequence's lookup: `hashes` are blocks `first`, `first + 1`, ... of its chain."""

    seq: Sequence
    first: int
    hashes: list[bytes]
    rows: np.ndarray | None = None
    """The chain's leading hits, [num_found, *block_shape] in the cache dtype (copied out
    of the fetched bytes on the worker, not on the engine thread); None while in flight."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when `rows` is (lookups that share a block wait for the one fetching it)."""
    answered_at: float | None = None
    """time.monotonic() when `rows` was set."""

    @property
    def num_found(self) -> int:
        return 0 if self.rows is None else len(self.rows)


class RemoteKVTier:
    """Lookups and writes of full KV blocks against a shared store, off the engine thread.

    Args:
        store: the KV store (tokenserve.state.kv_store.RedisKVStore).
        block_shape: shape of one block's rows as the runner reads them.
        dtype: the cache dtype (numpy).
        resave_after_s: a block saved or loaded this recently is not written again
            (half the store's TTL: a live block is refreshed before it expires).
        gather_s: how long an answered lookup waits for the others in flight before an
            idle engine admits it (`is_gathering`).
    """

    def __init__(self, store, block_shape: tuple[int, ...], dtype, resave_after_s: float,
                 gather_s: float = 0.05):
        self.store = store
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.resave_after_s, self.gather_s = resave_after_s, gather_s
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="tokenserve-kv-lookup")
        # one writer: blocks reach the store in the order they were queued
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tokenserve-kv-write")
        self._lock = threading.Lock()
        self._pending: dict[int, RemoteLookup] = {}  # seq_id -> lookup in flight or done
        # hash -> (the lookup fetching it, its index there): concurrent lookups of a shared
        # prefix (a system prompt) fetch it once
        self._fetching: dict[bytes, tuple[RemoteLookup, int]] = {}
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
            return any(lookup.rows is not None for lookup in self._pending.values())

    @property
    def is_gathering(self) -> bool:
        """Lookups are in flight and the earliest answered one has waited for them less than
        `gather_s`: an idle engine should not start a step for the answered ones yet."""
        with self._lock:
            answered = [lookup.answered_at for lookup in self._pending.values()
                        if lookup.answered_at is not None]
            in_flight = len(answered) < len(self._pending)
        return bool(answered) and in_flight and time.monotonic() - min(answered) < self.gather_s

    def _no_rows(self) -> np.ndarray:
        """The answer of a lookup that found nothing (or was cancelled): [0, *block_shape]."""
        return np.empty((0,) + self.block_shape, self.dtype)

    def is_loading(self, seq: Sequence) -> bool:
        return seq.seq_id in self._pending

    # -- lookups --------------------------------------------------------------------------
    def start_lookup(self, seq: Sequence, first: int, hashes: list[bytes],
                     block_size: int) -> None:
        """Looks up `hashes`, blocks `first`... of `seq`'s chain, on a worker thread."""
        lookup = RemoteLookup(seq, first, hashes)
        self._pending[seq.seq_id] = lookup
        self.num_query_tokens += len(hashes) * block_size
        with self._lock:
            borrowed = {i: self._fetching[h] for i, h in enumerate(hashes) if h in self._fetching}
            for i, hash_ in enumerate(hashes):
                if i not in borrowed:
                    self._fetching[hash_] = (lookup, i)
        # lookups run in the order they were started, so a lookup borrowed from has started
        # (or finished) before the one that waits for it: no thread waits on a queued task
        self._lookups.submit(self._fetch, lookup, borrowed)

    def _fetch(self, lookup: RemoteLookup, borrowed: dict[int, tuple[RemoteLookup, int]]
               ) -> None:
        own = [i for i in range(len(lookup.hashes)) if i not in borrowed]
        rows = []
        try:
            found = dict(zip(own, self.store.get_blocks([lookup.hashes[i] for i in own])))
            for i in range(len(lookup.hashes)):  # the chain's leading hits of the right size
                if i in borrowed:
                    owner, index = borrowed[i]
                    owner.done.wait()
                    if index >= owner.num_found:
                        break
                    rows.append(owner.rows[index])
                    continue
                payload = found.get(i)
                if payload is None or len(payload) != self.block_nbytes:
                    break
                rows.append(np.frombuffer(payload, self.dtype).reshape(self.block_shape))
        except Exception:  # noqa: BLE001 - a store bug must not strand the sequence
            log.exception("KV store lookup failed")
        finally:
            rows = np.stack(rows) if rows else self._no_rows()
            with self._lock:
                lookup.rows, lookup.answered_at = rows, time.monotonic()
                in_flight = any(other.rows is None for other in self._pending.values())
                for i in own:
                    if self._fetching.get(lookup.hashes[i], (None,))[0] is lookup:
                        del self._fetching[lookup.hashes[i]]
            lookup.done.set()
        self.on_ready()
        if in_flight and self.gather_s > 0:  # wakes the engine when the wait is over
            timer = threading.Timer(self.gather_s, self.on_ready)
            timer.daemon = True
            timer.start()

    def take(self, seq: Sequence) -> RemoteLookup | None:
        """The completed lookup of `seq`, once; None while it is in flight."""
        with self._lock:
            lookup = self._pending.get(seq.seq_id)
            if lookup is None or lookup.rows is None:
                return None
            return self._pending.pop(seq.seq_id)

    def take_finished(self) -> list[RemoteLookup]:
        """Every completed lookup, once each."""
        with self._lock:
            done = [lookup for lookup in self._pending.values() if lookup.rows is not None]
            for lookup in done:
                del self._pending[lookup.seq.seq_id]
        return done

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
                runner.write_kv_blocks(transfer.block_ids, transfer.rows)
            else:
                rows = runner.read_kv_blocks(transfer.block_ids)     # [n, *block_shape]
                self._remember(transfer.hashes)
                self.num_saved_blocks += len(transfer.hashes)
                self._writer.submit(self._put, transfer.hashes, rows)

    def _put(self, hashes: list[bytes], rows: np.ndarray) -> None:
        """Sends gathered rows (writer thread): their bytes as the cache holds them."""
        self.store.put_blocks([(h, rows[i].tobytes()) for i, h in enumerate(hashes)])

    def loaded(self, hashes: list[bytes]) -> None:
        """Blocks just loaded from the store are there already: no need to write them."""
        self._remember(hashes)

    def close(self, wait: bool = False) -> None:
        """Stops the worker and closes the store; `wait` lets queued writes finish first."""
        with self._lock:  # lookups cancelled before they ran must not hold up borrowers
            cancelled = [owner for owner, _ in self._fetching.values()]
        self._lookups.shutdown(wait=wait, cancel_futures=not wait)
        for owner in cancelled:
            if owner.rows is None:
                owner.rows = self._no_rows()
                owner.done.set()
        self._writer.shutdown(wait=wait, cancel_futures=not wait)
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
    # trace the row gather and scatter now (no rows move): the first load or save of a live
    # step would otherwise pay for tracing them (a few hundred ms)
    runner.write_kv_blocks([], runner.read_kv_blocks([]))
    return RemoteKVTier(store, runner.kv_block_shape, runner.kv_dtype,
                        resave_after_s=engine_config.kv_store_ttl_s / 2)
