"""Which LoRA adapters sit in the step's resident slots (plain Python, no TF).

The step's adapter table has `max_loras` slots (slot 0: the base model). Adapters are
registered with the server by name and path; a request carries its adapter (LoraRequest),
and before each schedule the engine gives the waiting requests' adapters slots, highest
priority first: a free slot, else the least recently used slot no running sequence reads.
An adapter that gets none waits (on disk, or in a small host cache of adapters checked when
they were loaded, already in the slot's layout, so writing a slot reads no file and packs
nothing on the engine's thread: it is a copy), and so do its requests (the scheduler skips
them, others go ahead). A slot is written between steps, on the engine's thread, in one
call: no step ever reads a slot half written, and a slot a running sequence reads is never
rewritten.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.engine.background import BackgroundWorker
from tokenserve.engine.lora_adapter import (LoraAdapterError, LoraRequest, LoraWeights,
                                            load_adapter)
from tokenserve.engine.lora_moe import EXPERT_ROLES, moe_role_shapes
from tokenserve.engine.request import Request, Sequence

log = logging.getLogger(__name__)


@dataclass
class AdapterCounts:
    """Requests and generated tokens of one adapter (the per-adapter metrics)."""

    num_requests: int = 0
    num_generated_tokens: int = 0


class LoraSlots:
    """The resident slots of one engine, and the adapters' host copies.

    Args:
        config: the base model's architecture (adapters are checked against it).
        max_loras: slots (EngineConfig.max_loras).
        max_rank: largest rank a slot takes (EngineConfig.max_lora_rank).
        write_slot: (slot, prepared values) -> None: the runner's slot write.
        prepare_slot: LoraWeights.layers -> the values write_slot takes (the runner's;
            called where an adapter is checked, any thread).
        experts: whether the slots hold a mixture of experts' factors
            (EngineConfig.lora_experts; adapters with them are refused where not).
    """

    def __init__(self, config: TransformerConfig, max_loras: int, max_rank: int,
                 write_slot: Callable[[int, object], None],
                 prepare_slot: Callable[[list], object], experts: bool = True):
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.experts = experts
        self.write_slot, self.prepare_slot = write_slot, prepare_slot
        self.slots: list[LoraRequest | None] = [None] * (max_loras + 1)  # [0]: the base
        self._last_used = [0] * (max_loras + 1)
        self._clock = itertools.count(1)
        self.num_slot_loads = 0
        self.counts: dict[str, AdapterCounts] = {}
        """By adapter name, for every adapter a request has used (bounded by the names
        the server registered)."""
        self._counts_lock = threading.Lock()
        self._host: OrderedDict[LoraRequest, tuple[LoraWeights, object]] = OrderedDict()
        self.max_host_adapters = max(8, 2 * max_loras)
        """Adapters kept in host memory after their check, with their prepared slot values
        (LRU); the rest are read again."""
        self._host_lock = threading.Lock()
        self._checks = BackgroundWorker("lora-check")
        """Where the server's checks run: a thread below the engine's priority, so a load
        takes the cores the step leaves (engine/background.py)."""

    def check(self, path: str | Path, lora: LoraRequest | None = None) -> LoraWeights:
        """Reads and checks an adapter (raising LoraAdapterError subclasses); nothing is
        loaded into a slot. With `lora`, its weights wait in the host cache for its first
        slot write. Any thread but the engine's (the server checks adapters off it): the
        work runs on the low-priority check thread while the caller waits."""
        return self._checks.run(self._check, path, lora)

    def _check(self, path: str | Path, lora: LoraRequest | None = None) -> LoraWeights:
        weights = load_adapter(path, self.config, self.max_rank, experts=self.experts)
        if lora is not None:
            self.remember(lora, weights)
        return weights

    def count_snapshot(self) -> dict[str, tuple[int, int]]:
        """Adapter name -> (requests, generated tokens) so far."""
        with self._counts_lock:
            return {name: (c.num_requests, c.num_generated_tokens)
                    for name, c in self.counts.items()}

    def remember(self, lora: LoraRequest, weights: LoraWeights) -> None:
        """Keeps `lora`'s checked weights, and its slot values prepared from them, in the
        host cache (any thread)."""
        self._store(lora, weights)

    def _store(self, lora: LoraRequest, weights: LoraWeights) -> tuple[LoraWeights, object]:
        cached = weights, self.prepare_slot(weights.layers)
        with self._host_lock:
            self._host[lora] = cached
            self._host.move_to_end(lora)
            while len(self._host) > self.max_host_adapters:
                self._host.popitem(last=False)
        return cached

    @property
    def serves_experts(self) -> bool:
        """Whether adapters may change a mixture of experts' experts (their own steps)."""
        return self.experts and bool(self.config.num_experts)

    def warmup_adapter(self, moe_role: str = "") -> LoraRequest:
        """An adapter of zeros (in the host cache), for warm-up requests that trace the
        adapter steps' graphs before users' requests meet them; `forget` it after.
        moe_role: one with (zero) factors of this role of a mixture of experts ("router",
        "expert_down"), for the steps of adapters that change it (engine/step/lora_moe.py's
        kinds)."""
        c = self.config
        layers: list[dict] = [{} for _ in range(c.num_layers)]
        count, width_in, width_out = moe_role_shapes(c).get(moe_role, (1, 0, 0))
        for i in range(c.num_layers):
            if moe_role and c.layer_has_experts(i):
                pair = (np.zeros([count, width_in, 1], np.float32),
                        np.zeros([count, 1, width_out], np.float32))
                layers[i][moe_role] = pair if moe_role in EXPERT_ROLES else (pair[0][0],
                                                                             pair[1][0])
        lora = LoraRequest(f"warmup-{moe_role}" if moe_role else "warmup", "", 0)
        self.remember(lora, LoraWeights(0, layers))
        return lora

    def forget(self, lora: LoraRequest) -> None:
        """Drops `lora` from its slot (the table keeps its numbers until overwritten) and
        from the host cache."""
        slot = self.slot_of(lora)
        if slot:
            self.slots[slot] = None
        with self._host_lock:
            self._host.pop(lora, None)
        with self._counts_lock:
            self.counts.pop(lora.name, None)

    def _cached(self, lora: LoraRequest) -> tuple[LoraWeights, object]:
        """`lora`'s weights and prepared slot values."""
        with self._host_lock:
            cached = self._host.get(lora)
        if cached is None:  # evicted from the host cache (or never checked): from disk,
            cached = self._store(lora, self._check(lora.path))  # on this thread
        return cached

    def weights_of(self, lora: LoraRequest) -> LoraWeights:
        """`lora`'s checked weights (the host cache's, else read again; any thread)."""
        return self._cached(lora)[0]

    def slot_of(self, lora: LoraRequest) -> int:
        """The slot holding `lora`, or 0."""
        return next((i for i, held in enumerate(self.slots) if i and held == lora), 0)

    def is_ready(self, seq: Sequence) -> bool:
        """Whether `seq` may be admitted now: no adapter, or its adapter in its slot."""
        request = seq.request
        return request.lora is None or self.slots[request.lora_slot] == request.lora

    def count(self, request: Request, num_new_tokens: int, new_request: bool) -> None:
        """Adds to the adapter's counters (called by the engine as requests progress)."""
        if request.lora is None:
            return
        with self._counts_lock:
            counts = self.counts.setdefault(request.lora.name, AdapterCounts())
            counts.num_requests += new_request
            counts.num_generated_tokens += num_new_tokens

    def assign(self, waiting: Iterable[Sequence], running: Iterable[Sequence]
               ) -> list[tuple[Request, LoraAdapterError]]:
        """Gives the adapters of `waiting` (in scheduling order) slots, writing each new
        one into its slot. Returns the requests whose adapter could not be read (their
        files gone or changed since they were registered), with the error."""
        pinned = {seq.request.lora_slot for seq in running if seq.request.lora is not None}
        failed: list[tuple[Request, LoraAdapterError]] = []
        for seq in waiting:
            request = seq.request
            if request.lora is None or self.slots[request.lora_slot] == request.lora:
                if request.lora is not None:
                    self._touch(request.lora_slot, pinned)
                continue
            slot = self.slot_of(request.lora)
            if not slot:
                slot = self._free_slot(pinned)
                if not slot:
                    continue  # every slot is read by a running sequence: it waits
                try:
                    weights, prepared = self._cached(request.lora)
                except LoraAdapterError as error:
                    failed.append((request, error))
                    continue
                self.slots[slot] = None  # never a slot named for weights it lacks
                self.write_slot(slot, prepared)
                self.slots[slot] = request.lora
                self.num_slot_loads += 1
                log.info("LoRA adapter %r into slot %d (rank %d)", request.lora.name, slot,
                         weights.rank)
            request.lora_slot = slot
            self._touch(slot, pinned)
        return failed

    def _touch(self, slot: int, pinned: set[int]) -> None:
        """Marks `slot` used now and keeps it for this round (a request admitted in this
        schedule must find its adapter still there)."""
        self._last_used[slot] = next(self._clock)
        pinned.add(slot)

    def _free_slot(self, pinned: set[int]) -> int:
        """An empty slot, else the least recently used one no running sequence reads; 0."""
        empty = [i for i in range(1, self.max_loras + 1) if self.slots[i] is None]
        if empty:
            return empty[0]
        unused = [i for i in range(1, self.max_loras + 1) if i not in pinned]
        return min(unused, key=self._last_used.__getitem__, default=0)
