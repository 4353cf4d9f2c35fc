"""A request and its sequences: the state the scheduler and engine move around (no TF)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenserve.engine.outputs import FinishReason
from tokenserve.errors import InvalidRequestError, PromptTooLongError
from tokenserve.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenserve.engine.detokenizer import IncrementalDetokenizer
    from tokenserve.engine.lora_adapter import LoraRequest
    from tokenserve.engine.ngram import NgramDrafter
    from tokenserve.engine.sampler.draw import SequenceSampler

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceState:
    """A sequence's sampler and detokenizer, owned by the engine."""

    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer
    finish_reported: bool = False
    """Its final CompletionOutput (with the finish reason) was emitted."""
    drafter: NgramDrafter | None = None
    """Proposes the drafts it checks when speculative decoding is on (greedy sequences)."""


@dataclass(eq=False)
class Sequence:
    """One of a request's `n` token streams.

    Prefill, chunked prefill, decode and recompute after preemption are one rule:
    `num_computed_tokens` catches up with `len(token_ids)`; when it does, a token is sampled.
    """

    request: "Request"
    index: int
    token_ids: list[int]
    """Prompt followed by the tokens generated so far."""
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    """Positions whose keys/values (or recurrent state) are in the cache."""
    block_ids: list[int] = field(default_factory=list)
    """KV-cache blocks in position order (an LSTM sequence holds one state slot)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache (local or remote) when first admitted."""
    state: SequenceState | None = None
    """Per-sequence sampling and detokenizing state, set by the engine's make_request."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple:
        """Scheduling order: higher priority first, then earlier arrival."""
        return (-self.request.priority, self.request.arrival_time, self.seq_id)


@dataclass(eq=False)
class Request:
    """A prompt with its sampling parameters, priority, deadline and `n` sequences."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None
    """time.monotonic() after which the request is aborted; None: no deadline."""
    arrival_time: float = field(default_factory=time.monotonic)
    wall_arrival_time: float = field(default_factory=time.time)
    trace_context: dict = field(default_factory=dict)
    seqs: list[Sequence] = field(default_factory=list)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    num_nonfinite_logits: int = 0
    """Tokens of this request chosen from logits that held a NaN or +inf."""
    lora: LoraRequest | None = None
    """The LoRA adapter its tokens run with; None: the base model."""
    lora_slot: int = 0
    """The resident slot of `lora` (engine/lora_slots.py), set before it is admitted; the
    runner reads it. 0: no adapter."""

    @property
    def cache_salt(self) -> bytes:
        """Mixed into the root of its KV blocks' hash chain: two adapters (or an adapter and
        the base) never share prefix-cache blocks."""
        return b"" if self.lora is None else self.lora.cache_key.encode()

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [Sequence(self, i, list(self.prompt_ids), len(self.prompt_ids))
                         for i in range(self.params.n)]

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.seqs)


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int, timeout_s: float | None = None) -> None:
    """Refuses a request no engine step could run.

    Raises:
        InvalidRequestError: an empty prompt, a token or stop token id outside the
            vocabulary, or a timeout that is not positive.
        PromptTooLongError: the prompt and max_tokens do not fit in `max_model_len`.
    """
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                  f"(size {vocab_size})")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"a stop token id is outside the vocabulary "
                                  f"(size {vocab_size})")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; the "
            f"prompt has {len(prompt_ids)} and max_tokens asks for {params.max_tokens} more")
    if timeout_s is not None and timeout_s <= 0:
        raise InvalidRequestError(f"timeout must be positive, got {timeout_s}")
