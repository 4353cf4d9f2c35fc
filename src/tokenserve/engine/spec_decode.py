"""Speculative decoding with n-gram drafts: which sequences draft, how many drafts a step
checks for each, and which of them a sequence keeps.

A drafting sequence's step computes its last token followed by drafts (ngram.NgramDrafter:
what followed the first time its tail occurred) and returns logits after each. The sequence
keeps every draft up to the first its sampler refuses (sampler/verify.py), then the token its
sampler takes there, or its own next token after all of them: 1 to len(drafts) + 1 tokens in
one step. The kept drafts' keys and values are in the cache already (the step computed them);
the rows of those refused lie past num_computed_tokens, so the next step writes over them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from tokenserve.engine.config import EngineConfig
from tokenserve.engine.ngram import NgramDrafter
from tokenserve.engine.outputs import CompletionOutput
from tokenserve.engine.request import Sequence
from tokenserve.engine.sampler.draw import SequenceSampler
from tokenserve.engine.sampler.verify import verified_tokens
from tokenserve.engine.scheduler_output import SampledSeq, ScheduledSeq

if TYPE_CHECKING:
    from tokenserve.engine.output_processor import OutputProcessor

log = logging.getLogger(__name__)


def _joined(deltas: list[CompletionOutput]) -> CompletionOutput:
    """One sequence's deltas of one step (several tokens: accepted drafts) as one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None if last.logprobs is None else [p for d in deltas for p in d.logprobs]
    return CompletionOutput(last.index, "".join(d.text for d in deltas),
                            [t for d in deltas for t in d.token_ids], logprobs,
                            last.finish_reason, last.stop_reason)


class SpeculativeDecoding:
    """The engine's drafting policy and draft checks, with their counters.

    Args:
        engine_config: num_speculative_tokens (0: off) and the n-gram lengths.
        runner: the model runner (only transformers draft).
        model_name: for the warnings.
        max_model_len: no draft runs past the context.
    """

    def __init__(self, engine_config: EngineConfig, runner, model_name: str,
                 max_model_len: int):
        self.engine_config = engine_config
        self.max_model_len = max_model_len
        # drafts need a KV cache that a step can write ahead into and then ignore: not an
        # LSTM's state, which every token overwrites
        self.enabled = (engine_config.num_speculative_tokens > 0
                        and getattr(runner, "is_transformer", False))
        if engine_config.num_speculative_tokens and not self.enabled:
            log.warning("speculative decoding is off for %s: only transformers draft (a "
                        "recurrent state cannot be written ahead and ignored)", model_name)
        elif self.enabled and runner.config.model.weight_format == "int8":
            # benchmarks: GPT-2-small int8 on a 2-core AVX2-only EPYC, one draft 1.3x a
            # plain step, two 1.45x, four 2.1x (float32: 1.1x, 1.2x, 1.3-1.5x)
            log.warning("speculative decoding with int8 weights: the int8 kernel's cost grows "
                        "with every drafted token (a quarter to a third of a plain step per "
                        "token on AVX2 without VNNI), so drafts pay only where most are kept")
        self.num_draft_tokens = 0
        """Drafted tokens checked so far."""
        self.num_accepted_tokens = 0
        """Drafted tokens the model agreed with so far."""

    def make_drafter(self, sampler: SequenceSampler) -> NgramDrafter | None:
        """An n-gram drafter for an unconstrained sequence when speculative decoding is on.
        Greedy sequences (penalized ones too) keep the tokens they would have had: a draft
        is kept only where it is the model's choice. Sampled ones keep their distribution
        (sampler.verify), but not their random draws, and whether a step drafts depends on
        what else runs (--speculative_max_seqs): so a seeded sampled request does not
        draft, and gives the same tokens whatever shares its batch."""
        knobs = self.engine_config
        params = sampler.params
        if not self.enabled or sampler.guide is not None:
            return None
        if params.temperature > 0.0 and params.seed is not None:
            return None
        return NgramDrafter(knobs.num_speculative_tokens, knobs.speculative_ngram_min,
                            knobs.speculative_ngram_max)

    def drafts(self, seq: Sequence, most: int) -> list[int]:
        """Drafts for a decoding sequence's next step (the scheduler asks): at most `most`,
        and never past its max_tokens or the context (the step also yields one token of the
        model's own)."""
        drafter = seq.state.drafter if seq.state is not None else None
        if drafter is None:
            return []
        room = min(seq.request.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens) - 1
        return drafter.propose(seq.token_ids, min(most, room))

    def accept(self, item: ScheduledSeq, logits: np.ndarray, outputs: OutputProcessor,
               now: float) -> SampledSeq:
        """Appends the drafts `item`'s sequence keeps and the token it takes after them
        (outputs.append), as one delta; stops at a token that ends the sequence.
        logits: float [num_logits, vocab], row i after the step's token i."""
        seq, drafts = item.seq, item.draft_ids
        deltas, accepted = [], 0
        for i, (token, bad) in enumerate(verified_tokens(seq.state.sampler, logits, drafts)):
            if bad:
                outputs.report_nonfinite(seq, token)
            deltas.append(outputs.append(seq, token, logits[i], now))
            if i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
            if deltas[-1].finish_reason is not None:
                break
        if seq.state.drafter is not None:
            seq.state.drafter.observe(len(drafts), accepted)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        return SampledSeq(seq, _joined(deltas), accepted)
