"""Decides, each step, which sequences compute how many tokens. Plain Python, no TF.

One rule for prefill, chunked prefill, decode and recompute: a scheduled sequence computes
`min(num_pending_tokens, budget left)` tokens. Running sequences go first (highest priority,
then earliest arrival), so decodes are never starved by prefills; the rest of the token
budget admits waiting sequences. When the cache is full, the lowest-priority, latest running
sequence is preempted by recompute: its blocks are freed and it re-queues with its tokens,
to be recomputed from scratch when there is room again.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from tokenserve.engine.cache_accounting import BlockAllocator, SlotAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.request import Request, Sequence, SequenceStatus
from tokenserve.errors import QueueFullError


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, starting at the sequence's num_computed_tokens."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue, running batch and cache accounting for one engine."""

    def __init__(self, config: EngineConfig, cache: BlockAllocator | SlotAllocator):
        self.config = config
        self.cache = cache
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap of (sort key, sequence)
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue ----------------------------------------------------------------------------
    @property
    def num_waiting_requests(self) -> int:
        return len({seq.request.request_id for _, seq in self.waiting})

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
        self.cache.free(seq)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if seq.request.is_finished:
            self.requests.pop(seq.request.request_id, None)

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
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.preempt_for_priority:
            self._preempt_for_waiting(out)
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=Sequence.sort_key):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(seq.num_pending_tokens, budget)
            if num_new == 0:
                continue
            while not self.cache.reserve(seq, num_new):
                victim = self._victim(exclude=scheduled | {seq.seq_id})
                if victim is None:
                    break
                self._preempt(victim, out)
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                scheduled.add(seq.seq_id)
                budget -= num_new
                continue
            self._preempt(seq, out)  # nothing left to evict: it waits for room itself
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][1]
            num_new = min(seq.num_pending_tokens, budget)
            if not self.cache.reserve(seq, num_new):
                break
            heapq.heappop(self.waiting)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.scheduled_time is None:
                seq.request.scheduled_time = time.time()
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

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
