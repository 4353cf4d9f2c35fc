"""From the tokens a step picked to the outputs callers see (as vLLM v1's OutputProcessor):
each token appended to its sequence, detokenized incrementally, checked against the stop
tokens, stop strings and limits, and gathered into one RequestOutput per request, a final
one with the request's stats when it ends.

It decides why a sequence ends; the scheduler ends it (Scheduler.update_from_output) and
frees its cache. Plain Python: no TensorFlow, no wire format.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from tokenserve.engine.request import Request, Sequence
from tokenserve.engine.sampler.draw import token_logprob
from tokenserve.engine.scheduler_output import SampledSeq
from tokenserve.sampling import SamplingParams
from tokenserve.stats import RequestStats, StatsSink

log = logging.getLogger(__name__)


def _cached_tokens(request: Request) -> int:
    return request.seqs[0].num_cached_tokens or 0


class OutputProcessor:
    """Appends tokens and builds RequestOutputs for one engine's model."""

    def __init__(self, tokenizer, eos_token_id: int, max_model_len: int, stats: StatsSink,
                 model_name: str, version: str):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.stats = stats
        """Where each finished request's RequestStats go (the engine's sink)."""
        self.model_name, self.version = model_name, version
        self.num_nonfinite_logits = 0
        """Tokens chosen from logits that held a NaN or +inf, so far (StepStats counts the
        step's)."""

    def detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        """A new sequence's detokenizer, which finds `params`' stop strings."""
        return IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)

    def append(self, seq: Sequence, token: int, logits: np.ndarray, now: float
               ) -> CompletionOutput:
        """Appends `token` to `seq` and returns its delta: the token, its logprob where
        asked (from `logits`, float [vocab], the row it was picked from), the text it
        completes, and why `seq` ends here, if it does (its held-back text then flushed
        unless a stop string ended it). now: time.time() of the step's update."""
        params, state = seq.request.params, seq.state
        logprobs = None
        if params.logprobs is not None:
            logprobs = [token_logprob(logits, token, params.logprobs)]
        seq.token_ids.append(token)
        state.sampler.observe(token)
        request = seq.request
        if seq.index == 0:
            request.first_token_time = request.first_token_time or now
            request.token_times.append(now)
        finish, stop_reason, text = None, None, ""
        if token == self.eos_token_id and not params.ignore_eos:
            finish = FinishReason.STOP
        elif token in params.stop_token_ids:
            finish, stop_reason = FinishReason.STOP, token
        else:
            text, matched = state.detokenizer.append(token)
            if matched is not None:
                finish, stop_reason = FinishReason.STOP, matched
        if finish is None and state.sampler.is_guide_done:
            finish = FinishReason.STOP  # the constrained output is complete
        if finish is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            finish = FinishReason.LENGTH
        if finish is not None:
            state.finish_reported = True
            if stop_reason is None or isinstance(stop_reason, int):
                text += state.detokenizer.flush()
        return CompletionOutput(seq.index, text, [token], logprobs, finish, stop_reason)

    def report_nonfinite(self, seq: Sequence, token: int) -> None:
        """Counts a token chosen from logits that held a NaN or +inf (StepStats), and logs
        the first one of each request: a model that makes them is broken, and its output is
        noise however defined the draw stays."""
        self.num_nonfinite_logits += 1
        request = seq.request
        request.num_nonfinite_logits += 1
        if request.num_nonfinite_logits == 1:
            version = f" version {self.version}" if self.version else ""
            log.warning("model %s%s: the logits for token %d of request %s held NaN or +inf "
                        "(chose token %d as if they were not there); the model or its weights "
                        "are broken", self.model_name, version, seq.num_output_tokens,
                        request.request_id, token)

    def make_outputs(self, sampled: list[SampledSeq]) -> list[RequestOutput]:
        """One RequestOutput per request that progressed, in the order of its first delta:
        a final one (with its stats) where the scheduler has ended every sequence of it."""
        deltas: dict[str, list[CompletionOutput]] = {}
        requests: dict[str, Request] = {}
        for took in sampled:
            request = took.seq.request
            deltas.setdefault(request.request_id, []).append(took.delta)
            requests[request.request_id] = request
        outputs = []
        for request_id, completions in deltas.items():
            request = requests[request_id]
            if request.is_finished:
                outputs.append(self.final(request, completions))
            else:
                outputs.append(RequestOutput(request_id, request.prompt_ids, completions, False,
                                             request.num_generated_tokens,
                                             num_cached_tokens=_cached_tokens(request)))
        return outputs

    def final(self, request: Request, completions: list[CompletionOutput]) -> RequestOutput:
        """The last output of a request: remaining deltas plus an entry for each ended seq."""
        for seq in request.seqs:
            if not seq.state.finish_reported:
                seq.state.finish_reported = True
                completions.append(CompletionOutput(seq.index, "", [], None, seq.finish_reason,
                                                    seq.stop_reason))
        finish_time = time.time()
        stats = RequestStats(
            request_id=request.request_id, model=self.model_name, version=self.version,
            arrival_time=request.wall_arrival_time, scheduled_time=request.scheduled_time,
            first_token_time=request.first_token_time, finish_time=finish_time,
            token_times=tuple(request.token_times), num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=request.num_generated_tokens,
            prefill_time_s=request.prefill_time_s, decode_time_s=request.decode_time_s,
            finish_reason=request.seqs[0].finish_reason.value, n=len(request.seqs),
            num_preemptions=sum(s.num_preemptions for s in request.seqs),
            num_nonfinite_logits=request.num_nonfinite_logits,
            trace_context=request.trace_context)
        self.stats.on_request(stats)
        metrics = {"arrival_time": stats.arrival_time, "scheduled_time": stats.scheduled_time,
                   "first_token_time": stats.first_token_time, "finish_time": finish_time,
                   "num_preemptions": stats.num_preemptions}
        return RequestOutput(request.request_id, request.prompt_ids, completions, True,
                             request.num_generated_tokens, metrics, _cached_tokens(request))
