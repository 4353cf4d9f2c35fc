"""What the engine hands back to its callers: plain dataclasses, no TensorFlow, no wire format."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values are the OpenAI API's `finish_reason` strings."""

    STOP = "stop"        # eos, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context
    ABORT = "abort"      # cancelled, disconnected, deadline passed, or preempted out of the queue


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) pairs, most likely first."""


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step computed, for the engine's update (as vLLM's ModelRunnerOutput)."""

    logits: "np.ndarray | None"
    """float32 [S, vocab]: each scheduled sequence's last-token logits, in scheduled order;
    None when the step only moved KV blocks to or from the remote tier."""
    duration_s: float
    """Wall time of the step, KV-tier transfers included."""


@dataclass
class CompletionOutput:
    """New output of one of a request's `n` sequences since the previous RequestOutput."""

    index: int
    text: str
    """Decoded text added by this step (stop strings already cut out)."""
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the sequence, if one did."""


@dataclass
class RequestOutput:
    """One streamed update of a request: the deltas of the sequences that progressed.

    The async engine yields these as deltas; `LLM.generate` returns one per request with
    every sequence's full text and tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_generated_tokens: int = 0
    """Total generated so far, over all `n` sequences (the OpenAI `completion_tokens`)."""
    metrics: dict = field(default_factory=dict)
    """Set on the final output: arrival/first-token/finish times and queue time, in seconds."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (the OpenAI usage's `cached_tokens`)."""
