"""Decides, each step, which sequences compute how many tokens. Plain Python, no TF.

One rule for prefill, chunked prefill, decode and recompute: a scheduled sequence computes
`min(num_pending_tokens, budget left)` tokens. Running sequences go first (highest priority,
then earliest arrival), so decodes are never starved by prefills; the rest of the token
budget admits waiting sequences. When the cache is full, the lowest-priority, latest running
sequence is preempted by recompute: its blocks are freed and it re-queues with its tokens,
to be recomputed from scratch when there is room again.

With prefix caching, a sequence admitted from the queue starts with the cached blocks of its
longest cached prefix (its num_computed_tokens starts there). With a remote KV tier, a
sequence with more full blocks than the local cache holds is looked up when it is queued;
at admission it takes the blocks found (queued as transfers that run before the step
computes), or, if the answer is not there yet, waits in the tier for it. Blocks are
written to the tier as they fill.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from tokenserve.engine.cache_accounting import BlockAllocator, SlotAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.kv_tier import KVLoad, KVSave, RemoteKVTier, RemoteLookup
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.prefix_cache import PrefixCacheStats
from tokenserve.engine.request import Request, Sequence, SequenceStatus
from tokenserve.engine.scheduler_output import SampledSeq, ScheduledSeq, SchedulerOutput
from tokenserve.errors import QueueFullError


class Scheduler:
    """Waiting queue, running batch and cache accounting for one engine."""

    def __init__(self, config: EngineConfig, cache: BlockAllocator | SlotAllocator,
                 kv_tier: RemoteKVTier | None = None,
                 drafter: Callable[[Sequence, int], list[int]] | None = None):
        self.config = config
        self.drafter = drafter
        """(decoding sequence, most drafts) -> drafts to check with its next token, or None:
        no speculative decoding."""
        self.cache = cache
        self.kv_tier = kv_tier
        self._transfers: list[KVSave | KVLoad] = []  # queued for the next step
        self._looked_up: set[int] = set()  # seq ids whose remote lookup was started
        self._in_tier: dict[int, Sequence] = {}  # out of the queue, waiting for a lookup
        self._queried: set[int] = set()  # seq ids counted in the prefix-cache queries
        if kv_tier is not None:
            cache.on_evict = self._on_evict
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap of (sort key, sequence)
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.can_admit: Callable[[Sequence], bool] | None = None
        """Whether a waiting sequence may start now (its LoRA adapter is resident); one
        that may not stays queued while those behind it are admitted. None: all may."""

    # -- queue ----------------------------------------------------------------------------
    @property
    def num_waiting_requests(self) -> int:
        return len({seq.request.request_id for _, seq in self.waiting}
                   | {seq.request.request_id for seq in self._loading()})

    def _loading(self) -> list[Sequence]:
        return list(self._in_tier.values())

    @property
    def num_waiting_tokens(self) -> int:
        return sum(seq.num_tokens for _, seq in self.waiting)

    def add(self, request: Request) -> None:
        """Queues a request, or raises QueueFullError at once if the queue is at a limit."""
        if self.num_waiting_requests >= self.config.max_queue_requests:
            raise QueueFullError(f"the queue is full: {self.num_waiting_requests} requests "
                                 f"waiting (limit {self.config.max_queue_requests})")
        tokens = self.num_waiting_tokens + request.num_prompt_tokens * len(request.seqs)
        if tokens > self.config.max_queue_tokens:
            raise QueueFullError(f"the queue is full: {tokens} prompt tokens would be waiting "
                                 f"(limit {self.config.max_queue_tokens})")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self._enqueue(seq)
            if self.kv_tier is not None:
                self._look_up_remote(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.sort_key(), seq))

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason=None) -> None:
        """Ends a sequence and frees its cache at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting = [(k, s) for k, s in self.waiting if s is not seq]
            heapq.heapify(self.waiting)
        if self.kv_tier is not None:
            self.kv_tier.cancel(seq)
            self._looked_up.discard(seq.seq_id)
            self._in_tier.pop(seq.seq_id, None)
            self._save_finished(seq)
        self._queried.discard(seq.seq_id)
        self.cache.free(seq)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledSeq],
                           duration_s: float) -> None:
        """Records what a step computed, then ends (and frees at once) each sequence that
        the output processor found ended, in the order it found them.

        Args:
            out: the step's scheduled sequences, less those aborted while it computed.
            sampled: what each sequence that sampled or checked drafts took.
            duration_s: the step's time, added to each scheduled request's prefill or
                decode time.
        """
        drafted = {s.seq.seq_id: s for s in sampled}
        for item in out.scheduled:
            seq, request = item.seq, item.seq.request
            if item.draft_ids:  # its last token, and the drafts it kept unless it ended
                took = drafted[seq.seq_id]
                ended = took.delta.finish_reason is not None
                seq.num_computed_tokens += 1 + (0 if ended else took.num_accepted)
                request.decode_time_s += duration_s
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if item.is_prefill:
                request.prefill_time_s += duration_s
            else:
                request.decode_time_s += duration_s
        for took in sampled:
            if took.delta.finish_reason is not None:
                self.finish(took.seq, took.delta.finish_reason, took.delta.stop_reason)

    def abort(self, request_id: str) -> Request | None:
        """Finishes every sequence of a request with ABORT; returns it, or None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            for seq in request.seqs:
                self.finish(seq, FinishReason.ABORT)
        return request

    def expired(self, now: float | None = None) -> list[Request]:
        """Requests past their deadline (the engine aborts them)."""
        now = time.monotonic() if now is None else now
        return [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._transfers
                     or (self.kv_tier is not None and self.kv_tier.num_loading))

    @property
    def has_runnable_work(self) -> bool:
        """has_work, less sequences that only wait for the remote tier, and less answered
        lookups while the tier gathers the others in flight (nothing else to run)."""
        return bool(self.waiting or self.running or self._transfers
                    or (self.kv_tier is not None and self.kv_tier.has_finished
                        and not self.kv_tier.is_gathering))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative counters of the prefix cache and the remote tier (zeros without)."""
        cache, tier = self.cache, self.kv_tier
        remote = {} if tier is None else dict(
            num_remote_query_tokens=tier.num_query_tokens,
            num_remote_hit_tokens=tier.num_hit_tokens,
            num_remote_saved_blocks=tier.num_saved_blocks, num_remote_errors=tier.num_errors)
        return PrefixCacheStats(getattr(cache, "num_query_tokens", 0),
                                getattr(cache, "num_hit_tokens", 0), **remote)

    def reset_prefix_cache_stats(self) -> None:
        """Zeroes the prefix-cache query and hit counters, local and remote."""
        for counters in (self.cache, self.kv_tier):
            for name in ("num_query_tokens", "num_hit_tokens"):
                if hasattr(counters, name):
                    setattr(counters, name, 0)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in self.running:
            filled = self.cache.cache_computed(seq)
            if filled and self.kv_tier is not None:
                self._save(filled)
        if self.kv_tier is not None:
            self._admit_looked_up()
        if self.config.preempt_for_priority:
            self._preempt_for_waiting(out)
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        # drafts for the first sequences, as long as the step stays within its token cap
        draft_room = self.config.speculative_max_step_tokens - len(self.running)
        for seq in sorted(self.running, key=Sequence.sort_key):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_pending_tokens, budget)
            if num_new == 0:
                continue
            drafts = []
            if (self.drafter is not None and seq.num_pending_tokens == 1 and budget > 1
                    and draft_room > 0
                    and len(self.running) <= self.config.speculative_max_seqs):
                drafts = self.drafter(seq, min(budget - 1, draft_room))
                if drafts and not self.cache.reserve(seq, 1 + len(drafts)):
                    drafts = []  # drafts never preempt anyone: room for its one token only
                num_new += len(drafts)
                draft_room -= len(drafts)
            while not self.cache.reserve(seq, num_new):
                victim = self._victim(exclude=scheduled | {seq.seq_id})
                if victim is None:
                    break
                self._preempt(victim, out)
            else:
                out.scheduled.append(ScheduledSeq.drafting(seq, drafts) if drafts
                                     else ScheduledSeq.of(seq, num_new))
                scheduled.add(seq.seq_id)
                budget -= num_new
                continue
            self._preempt(seq, out)  # nothing left to evict: it waits for room itself
        held_back = []  # waiting sequences can_admit refuses this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][1]
            if self.can_admit is not None and not self.can_admit(seq):
                held_back.append(heapq.heappop(self.waiting))
                continue
            num_hit = self.cache.match_prefix(seq) if not seq.block_ids else None
            if num_hit is not None and self.kv_tier is not None and self.kv_tier.is_loading(seq):
                lookup = self.kv_tier.take(seq)
                if lookup is None:  # not answered yet: it waits in the tier, holding its
                    heapq.heappop(self.waiting)  # local hits, while others are admitted
                    self._in_tier[seq.seq_id] = seq
                    continue
                self._load_found(seq, lookup)
            num_new = min(seq.num_pending_tokens, budget)
            if not self.cache.reserve(seq, num_new):
                if seq.block_ids:  # give its cached blocks back until it fits
                    self.cache.free(seq)
                    seq.num_computed_tokens = 0
                break
            if num_hit is not None and seq.seq_id not in self._queried:
                self._queried.add(seq.seq_id)  # a remote lookup may have counted it already
                self.cache.count_query(seq.num_tokens, num_hit)
            heapq.heappop(self.waiting)
            if seq.num_cached_tokens is None:  # first admission, not a resume after preemption
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.scheduled_time is None:
                seq.request.scheduled_time = time.time()
            out.scheduled.append(ScheduledSeq.of(seq, num_new))
            budget -= num_new
        for item in held_back:
            heapq.heappush(self.waiting, item)
        out.kv_transfers, self._transfers = self._transfers, []
        return out

    # -- remote KV tier -------------------------------------------------------------------
    def _look_up_remote(self, seq: Sequence) -> None:
        """Starts a remote lookup of the blocks after those the local cache holds now, if
        `seq` has any and was not looked up already (it answers while `seq` queues)."""
        if seq.seq_id in self._looked_up:
            return
        self._looked_up.add(seq.seq_id)
        end = self.cache.num_cacheable_blocks(seq)
        hashes = self.cache.block_hashes(seq, end)
        first = 0
        while first < end and self.cache.lookup(hashes[first]) is not None:
            first += 1
        if first < end:
            self.kv_tier.start_lookup(seq, first, hashes[first:], self.cache.block_size)

    def _load_found(self, seq: Sequence, lookup: RemoteLookup) -> None:
        """Gives `seq` blocks for the remote hits that follow its local ones and queues
        their rows to be written into them. The local hits may have grown or shrunk since
        the lookup started: found blocks past a gap are of no use."""
        skip = len(seq.block_ids) - lookup.first  # found blocks the local cache now holds
        if skip < 0 or skip >= lookup.num_found:
            return
        to_fill = self.cache.adopt(seq, lookup.hashes[skip:lookup.num_found])
        if to_fill is None:
            return
        if to_fill:
            found = [skip + i for i, _ in to_fill]
            contiguous = found == list(range(found[0], found[0] + len(found)))
            self._transfers.append(KVLoad(  # usually a view of the fetched rows, not a copy
                [block for _, block in to_fill],
                lookup.rows[found[0]:found[-1] + 1] if contiguous else lookup.rows[found]))
            self.kv_tier.loaded([lookup.hashes[skip + i] for i, _ in to_fill])
        self.kv_tier.count_hits((lookup.num_found - skip) * self.cache.block_size)

    def _admit_looked_up(self) -> None:
        """Sequences that waited in the tier and whose lookup has answered: blocks for what
        was found, back to the queue (admitted in this same schedule() if there is room)."""
        for seq in list(self._in_tier.values()):
            lookup = self.kv_tier.take(seq)
            if lookup is None:
                continue
            del self._in_tier[seq.seq_id]
            num_local = seq.num_computed_tokens
            self._load_found(seq, lookup)
            if seq.seq_id not in self._queried:
                self._queried.add(seq.seq_id)
                self.cache.count_query(seq.num_tokens, num_local)
            self._enqueue(seq)

    def _save(self, pairs: list[tuple[bytes, int]]) -> None:
        """Queues a write of those (hash, block id) pairs the store may lack."""
        pairs = [(h, b) for h, b in pairs if self.kv_tier.needs_save(h)]
        if pairs:
            self._transfers.append(KVSave([h for h, _ in pairs], [b for _, b in pairs]))

    def take_transfers(self) -> list[KVSave | KVLoad]:
        """Transfers queued since the last schedule(): between steps, only the saves of
        sequences that ended, which the engine runs before their last output goes out."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def _on_evict(self, hash_: bytes, block: int) -> None:
        self._save([(hash_, block)])

    def _save_finished(self, seq: Sequence) -> None:
        """Queues a save of the full blocks of an ending sequence the store may lack."""
        self.cache.cache_computed(seq)
        num_full = min(seq.num_computed_tokens // self.cache.block_size, len(seq.block_ids))
        self._save([(h, b) for h, b in zip(self.cache.block_hashes(seq, num_full),
                                            seq.block_ids) if self.cache.lookup(h) == b])

    def _victim(self, exclude: set[int]) -> Sequence | None:
        """The running sequence to preempt first: lowest priority, then latest arrival."""
        candidates = [s for s in self.running if s.seq_id not in exclude]
        return max(candidates, key=Sequence.sort_key, default=None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self._enqueue(seq)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Evicts lower-priority running sequences while a higher-priority one cannot start."""
        while self.waiting:
            head = self.waiting[0][1]
            fits = (len(self.running) < self.config.max_num_seqs
                    and self.cache.blocks_needed(head, min(head.num_pending_tokens,
                                                           self.config.max_num_batched_tokens))
                    <= self.cache.num_free_blocks)
            if fits:
                return
            victim = self._victim(exclude=set())
            if victim is None or victim.request.priority >= head.request.priority:
                return
            self._preempt(victim, out)
