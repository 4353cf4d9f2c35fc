"""The scheduler's two seams, as vLLM v1's: SchedulerOutput, what it hands the runner each
step (ScheduledSeq: each sequence's share), and SampledSeq, what it takes back in
Scheduler.update_from_output once the engine has picked the step's tokens. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve.engine.kv_tier import KVLoad, KVSave
from tokenserve.engine.outputs import CompletionOutput
from tokenserve.engine.request import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step, with what the runner reads of it copied when it is
    scheduled: the runner computes without the engine's lock, and an abort in the meantime
    frees the sequence's blocks (its block_ids become []), which a step built from the live
    sequence would then read as an empty context."""

    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, starting at `start`."""
    start: int
    """The sequence's num_computed_tokens when it was scheduled."""
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """The tokens computed this step: the sequence's token_ids[start:start + num_new], or
    with drafts, its last token and the drafts."""
    draft_ids: tuple[int, ...] = ()
    """Drafted tokens checked this step (speculative decoding): the step returns logits for
    each of its tokens, not only the last."""
    is_prefill: bool = False
    """The step's time counts as the request's prefill time: its tokens are prompt tokens
    of a sequence that has generated none yet."""

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> "ScheduledSeq":
        start = seq.num_computed_tokens
        is_prefill = (start + num_new_tokens <= seq.num_prompt_tokens
                      and seq.num_output_tokens == 0)
        return cls(seq, num_new_tokens, start, tuple(seq.block_ids),
                   tuple(seq.token_ids[start:start + num_new_tokens]), is_prefill=is_prefill)

    @classmethod
    def drafting(cls, seq: Sequence, draft_ids: list[int]) -> "ScheduledSeq":
        """A decoding sequence's last token followed by drafts to check."""
        return cls(seq, 1 + len(draft_ids), seq.num_computed_tokens, tuple(seq.block_ids),
                   (seq.token_ids[-1], *draft_ids), tuple(draft_ids))

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns for this sequence."""
        return 1 + len(self.draft_ids)

    @property
    def samples(self) -> bool:
        """Whether the engine draws the sequence's next token from this step's last row of
        logits: no drafts, and the step computes every token the sequence has (a prefill
        chunk before the last does not)."""
        return not self.draft_ids and self.start + self.num_new_tokens >= len(self.seq.token_ids)


@dataclass(frozen=True)
class SampledSeq:
    """What a scheduled sequence took from its step's logits: one token, or more where it
    kept drafts (Scheduler.update_from_output's input, with the SchedulerOutput)."""

    seq: Sequence
    delta: CompletionOutput
    """Its new tokens and text, and why it ends here (finish_reason), if it does."""
    num_accepted: int = 0
    """Drafts it kept (speculative decoding)."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    kv_transfers: list[KVSave | KVLoad] = field(default_factory=list)
    """Block copies between the cache and the remote tier, run in order before the step."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.kv_transfers
