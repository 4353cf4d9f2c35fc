"""The synchronous engine: schedule, execute, update — one step at a time.

Used directly by the offline `LLM` and driven by `AsyncEngine`'s loop thread. It never
sees JSON or protobuf, and imports TensorFlow only through its runner.
"""

from __future__ import annotations

import logging
import time
import uuid

from tokenserve.config import GenerationConfig
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.kv_tier import setup_prefix_cache
from tokenserve.engine.prefix_cache import PrefixCacheStats
from tokenserve.engine.guided import GuidedDecoding
from tokenserve.engine.outputs import (CompletionOutput, FinishReason, ModelRunnerOutput,
                                       RequestOutput)
from tokenserve.engine.request import Request, Sequence, SequenceState
from tokenserve.engine.ngram import NgramDrafter
from tokenserve.engine.sampler import SequenceSampler, greedy_batch, sample_batch, token_logprob
from tokenserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from tokenserve.errors import InvalidRequestError, PromptTooLongError
from tokenserve.sampling import SamplingParams
from tokenserve.stats import RequestStats, SchedulerStats, StatsSink, StepStats

log = logging.getLogger(__name__)


def _cached_tokens(request: Request) -> int:
    return request.seqs[0].num_cached_tokens or 0


def _joined(deltas: list[CompletionOutput]) -> CompletionOutput:
    """One sequence's deltas of one step (several tokens: accepted drafts) as one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None if last.logprobs is None else [p for d in deltas for p in d.logprobs]
    return CompletionOutput(last.index, "".join(d.text for d in deltas),
                            [t for d in deltas for t in d.token_ids], logprobs,
                            last.finish_reason, last.stop_reason)


class LLMEngine:
    """Continuous batching over one model: requests join and leave at every step."""

    def __init__(self, runner, tokenizer, engine_config: EngineConfig = EngineConfig(),
                 stats: StatsSink | None = None, model_name: str | None = None,
                 version: str = ""):
        self.runner, self.tokenizer = runner, tokenizer
        self.config: GenerationConfig = runner.config
        self.engine_config = engine_config
        self.stats = stats or StatsSink()
        self.model_name, self.version = model_name or self.config.name, version
        kv_tier = setup_prefix_cache(runner, engine_config, self.model_name, version)
        # drafts need a KV cache that a step can write ahead into and then ignore: not an
        # LSTM's state, which every token overwrites
        self.speculative = (engine_config.num_speculative_tokens > 0
                            and getattr(runner, "is_transformer", False))
        self.scheduler = Scheduler(engine_config, runner.cache, kv_tier,
                                   drafter=self._drafts if self.speculative else None)
        if engine_config.num_speculative_tokens and not self.speculative:
            log.warning("speculative decoding is off for %s: only transformers draft (a "
                        "recurrent state cannot be written ahead and ignored)", self.model_name)
        elif self.speculative and self.config.model.weight_format == "int8":
            # benchmarks: GPT-2-small int8 on a 2-core AVX2-only EPYC, one draft 1.3x a
            # plain step, two 1.45x, four 2.1x (float32: 1.1x, 1.2x, 1.3-1.5x)
            log.warning("speculative decoding with int8 weights: the int8 kernel's cost grows "
                        "with every drafted token (a quarter to a third of a plain step per "
                        "token on AVX2 without VNNI), so drafts pay only where most are kept")
        self.num_steps = 0
        self._step_nonfinite = 0  # tokens of this step chosen from NaN or +inf logits
        self.num_draft_tokens = 0
        """Drafted tokens checked so far (speculative decoding)."""
        self.num_accepted_tokens = 0
        """Drafted tokens the model agreed with so far."""
        self.guided = GuidedDecoding(tokenizer, self.config.model.vocab_size,
                                     self.config.eos_token_id)

    @property
    def max_model_len(self) -> int:
        return min(self.config.max_seq_len, self.runner.cache.capacity_tokens)

    # -- requests -------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, priority: int = 0,
                     timeout_s: float | None = None, trace_context: dict | None = None
                     ) -> Request:
        """Validates a request (raising InvalidRequestError / PromptTooLongError)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(size {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"a stop token id is outside the vocabulary (size {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(prompt_ids)} and max_tokens asks for {params.max_tokens} more")
        if timeout_s is not None and timeout_s <= 0:
            raise InvalidRequestError(f"timeout must be positive, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params,
                          priority=priority, deadline=deadline, trace_context=trace_context or {})
        for seq in request.seqs:  # an invalid constraint raises here, before taking a slot
            guide = None if params.structured is None else self.guided.make_guide(
                params.structured)
            sampler = SequenceSampler(params, seq.index, vocab, prompt_ids, guide)
            seq.state = SequenceState(sampler, IncrementalDetokenizer(self.tokenizer, params.stop),
                                      drafter=self._make_drafter(sampler))
        return request

    def _make_drafter(self, sampler: SequenceSampler) -> NgramDrafter | None:
        """An n-gram drafter for an unconstrained sequence when speculative decoding is on.
        Greedy sequences (penalized ones too) keep the tokens they would have had: a draft
        is kept only where it is the model's choice. Sampled ones keep their distribution
        (SequenceSampler.verify), but not their random draws, and whether a step drafts
        depends on what else runs (--speculative_max_seqs): so a seeded sampled request
        does not draft, and gives the same tokens whatever shares its batch."""
        knobs = self.engine_config
        params = sampler.params
        if not self.speculative or sampler.guide is not None:
            return None
        if params.temperature > 0.0 and params.seed is not None:
            return None
        return NgramDrafter(knobs.num_speculative_tokens, knobs.speculative_ngram_min,
                            knobs.speculative_ngram_max)

    def _drafts(self, seq: Sequence, most: int) -> list[int]:
        """Drafts for a decoding sequence's next step: at most `most`, and never past its
        max_tokens or the context (the step also yields one token of the model's own)."""
        drafter = seq.state.drafter if seq.state is not None else None
        if drafter is None:
            return []
        room = min(seq.request.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens) - 1
        return drafter.propose(seq.token_ids, min(most, room))

    def add_request(self, request: Request) -> None:
        """Queues a request made by make_request (QueueFullError when the queue is full)."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its cache; returns its final output."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        # the queues' gauges move now: when this was the last request, no step follows
        self.stats.on_scheduler(SchedulerStats(
            model=self.model_name, version=self.version, time=time.time(),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            cache_usage=self.scheduler.cache.usage))
        return self._final(request, [])

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache counters (zeros without prefix caching)."""
        cache, tier = self.scheduler.cache, self.scheduler.kv_tier
        remote = {} if tier is None else dict(
            num_remote_query_tokens=tier.num_query_tokens,
            num_remote_hit_tokens=tier.num_hit_tokens,
            num_remote_saved_blocks=tier.num_saved_blocks, num_remote_errors=tier.num_errors)
        return PrefixCacheStats(getattr(cache, "num_query_tokens", 0),
                                getattr(cache, "num_hit_tokens", 0), **remote)

    def reset_prefix_cache_stats(self) -> None:
        """Zeroes the prefix-cache counters (after warm-up: only users' requests count)."""
        for counters in (self.scheduler.cache, self.scheduler.kv_tier):
            for name in ("num_query_tokens", "num_hit_tokens"):
                if hasattr(counters, name):
                    setattr(counters, name, 0)

    def close(self) -> None:
        """Releases the remote KV tier (its writer thread and connection), letting queued
        block writes finish so another replica can still find them."""
        if self.scheduler.kv_tier is not None:
            self.scheduler.kv_tier.close(wait=True)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that progressed or ended."""
        outputs, scheduled = self.schedule()
        if not scheduled.is_empty:
            outputs += self.update(scheduled, self.execute(scheduled))
        return outputs

    def schedule(self) -> tuple[list[RequestOutput], SchedulerOutput]:
        """Aborts requests past their deadline, then picks this step's tokens.

        Returns the aborted requests' final outputs and the scheduler's decision."""
        expired = [self.abort(r.request_id) for r in self.scheduler.expired()]
        return [o for o in expired if o is not None], self.scheduler.schedule()

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """The runner's compiled step. Touches no Python state, so the async engine runs it
        without holding its lock."""
        started = time.perf_counter()
        if scheduled.kv_transfers:  # block copies to and from the remote tier, in order
            self.scheduler.kv_tier.apply(self.runner, scheduled.kv_transfers)
        if not scheduled.scheduled:
            return ModelRunnerOutput(None, time.perf_counter() - started)
        logits = self.runner.execute(scheduled)
        return ModelRunnerOutput(logits, time.perf_counter() - started)

    def update(self, scheduled: SchedulerOutput, output: ModelRunnerOutput
               ) -> list[RequestOutput]:
        """Samples, detokenizes, checks stops and emits stats for the computed tokens.

        Sequences that finished while the step computed (aborted) are skipped."""
        if not scheduled.scheduled:  # the step only moved KV blocks
            return []
        logits, duration = output.logits, output.duration_s
        live = [s for s in scheduled.scheduled if not s.seq.is_finished]
        if len(live) < len(scheduled.scheduled):
            rows, first = [], 0
            for item in scheduled.scheduled:
                if not item.seq.is_finished:
                    rows.extend(range(first, first + item.num_logits))
                first += item.num_logits
            scheduled.scheduled, logits = live, logits[rows]
        accepted_before = self.num_accepted_tokens
        self._step_nonfinite = 0
        outputs = self._update(scheduled, logits, duration)
        self._emit_step_stats(scheduled, duration, self.num_accepted_tokens - accepted_before)
        self._save_ended()
        return outputs

    def _save_ended(self) -> None:
        """Sends the last full blocks of sequences that just ended to the remote tier now,
        before their last output goes out (not before the next step): a next turn sent at
        once to another replica then finds them."""
        tier = self.scheduler.kv_tier
        if tier is not None:
            transfers = self.scheduler.take_transfers()
            if transfers:
                tier.apply(self.runner, transfers)

    def _update(self, scheduled: SchedulerOutput, logits, duration: float) -> list[RequestOutput]:
        now = time.time()
        sampling, rows, drafting = [], [], []
        row = 0
        for item in scheduled.scheduled:
            seq = item.seq
            row += item.num_logits
            if item.draft_ids:  # its last token; the drafts count once they are checked
                seq.num_computed_tokens += 1
                seq.request.decode_time_s += duration
                drafting.append((item, row - item.num_logits))
                continue
            row_of_last = row - 1
            seq.num_computed_tokens += item.num_new_tokens
            in_prefill = seq.num_computed_tokens <= seq.num_prompt_tokens and seq.num_output_tokens == 0
            if in_prefill:
                seq.request.prefill_time_s += duration
            else:
                seq.request.decode_time_s += duration
            if item.samples:  # (now num_pending_tokens == 0; the runner asks the same)
                sampling.append(seq)
                rows.append(row_of_last)
        deltas: dict[str, list[CompletionOutput]] = {}
        requests: dict[str, Request] = {}
        if sampling:
            tokens, broken = sample_batch(self._masked(logits[rows], sampling),
                                          [seq.state.sampler for seq in sampling])
            for seq, token, bad in zip(sampling, tokens, broken):
                if bad:
                    self._report_nonfinite(seq, token)
            for seq, row, token in zip(sampling, rows, tokens):
                deltas.setdefault(seq.request.request_id, []).append(
                    self._append(seq, token, logits[row], now))
                requests[seq.request.request_id] = seq.request
        for item, first in drafting:
            deltas.setdefault(item.seq.request.request_id, []).append(
                self._accept_drafts(item, logits[first:first + item.num_logits], now))
            requests[item.seq.request.request_id] = item.seq.request
        outputs = []
        for request_id, completions in deltas.items():
            request = requests[request_id]
            if request.is_finished:
                outputs.append(self._final(request, completions))
            else:
                outputs.append(RequestOutput(request_id, request.prompt_ids, completions, False,
                                             request.num_generated_tokens,
                                             num_cached_tokens=_cached_tokens(request)))
        return outputs

    def _report_nonfinite(self, seq: Sequence, token: int) -> None:
        """Counts a token chosen from logits that held a NaN or +inf (StepStats), and logs
        the first one of each request: a model that makes them is broken, and its output is
        noise however defined the draw stays."""
        self._step_nonfinite += 1
        request = seq.request
        request.num_nonfinite_logits += 1
        if request.num_nonfinite_logits == 1:
            version = f" version {self.version}" if self.version else ""
            log.warning("model %s%s: the logits for token %d of request %s held NaN or +inf "
                        "(chose token %d as if they were not there); the model or its weights "
                        "are broken", self.model_name, version, seq.num_output_tokens,
                        request.request_id, token)

    def _masked(self, logits, sampling: list[Sequence]):
        """The sampling rows' logits (the caller's copy, masked in place) with each
        structured-output constraint applied."""
        rows = [i for i, seq in enumerate(sampling) if seq.state.sampler.guide is not None]
        if rows:
            samplers = [sampling[i].state.sampler for i in rows]
            self.guided.apply(logits, rows, [s.guide for s in samplers],
                              [s.is_greedy for s in samplers])
        return logits

    def _accept_drafts(self, item: ScheduledSeq, logits, now: float) -> CompletionOutput:
        """Keeps the drafts the sequence's sampler takes (SequenceSampler.verify: greedy, its
        argmax after each token is the next draft), then appends the token it takes where it
        refused one, or its own next token after all of them: 1 to len(drafts) + 1 tokens, as
        one delta. logits: [num_logits, vocab], row i after the step's token i.

        The kept drafts' keys and values are in the cache already (the step computed them);
        the rows of those refused are past num_computed_tokens, so the next step writes over
        them."""
        seq, drafts = item.seq, item.draft_ids
        sampler = seq.state.sampler
        # greedy: every row's choice at once; otherwise row by row, so that penalties see the
        # tokens kept before
        best, broken = greedy_batch(logits) if sampler.is_greedy else (None, None)
        deltas, accepted = [], 0
        for i in range(len(drafts) + 1):
            if best is not None:
                token, bad = best[i], broken[i]
            else:
                token = (sampler.verify(logits[i], drafts[i]) if i < len(drafts)
                         else sampler.sample(logits[i]))
                bad = sampler.saw_nonfinite
            if bad:
                self._report_nonfinite(seq, token)
            deltas.append(self._append(seq, token, logits[i], now))
            if i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
            if seq.is_finished:
                break
        if seq.state.drafter is not None:
            seq.state.drafter.observe(len(drafts), accepted)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        if not seq.is_finished:
            seq.num_computed_tokens += accepted
        return _joined(deltas)

    def _append(self, seq: Sequence, token: int, logits, now: float) -> CompletionOutput:
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
        if token == self.config.eos_token_id and not params.ignore_eos:
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
            self.scheduler.finish(seq, finish, stop_reason)
        return CompletionOutput(seq.index, text, [token], logprobs, finish, stop_reason)

    def _final(self, request: Request, completions: list[CompletionOutput]) -> RequestOutput:
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

    def _emit_step_stats(self, scheduled: SchedulerOutput, duration: float,
                         num_accepted: int) -> None:
        self.num_steps += 1
        num_decode = sum(s.num_new_tokens for s in scheduled.scheduled
                         if s.seq.num_output_tokens > 0 and (s.num_new_tokens == 1 or s.draft_ids))
        self.stats.on_step(StepStats(
            model=self.model_name, version=self.version, time=time.time(), duration_s=duration,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_batched_tokens=scheduled.num_batched_tokens,
            num_prefill_tokens=scheduled.num_batched_tokens - num_decode,
            num_decode_tokens=num_decode, cache_usage=self.scheduler.cache.usage,
            num_preemptions=len(scheduled.preempted),
            num_draft_tokens=sum(len(s.draft_ids) for s in scheduled.scheduled),
            num_accepted_tokens=num_accepted, num_nonfinite_logits=self._step_nonfinite))
