"""The synchronous engine: schedule, execute, update — one step at a time.

Used directly by the offline `LLM` and driven by `AsyncEngine`'s loop thread. Its update
picks the step's tokens (sampler/, and spec_decode.py for drafts), hands each to the output
processor (appending, detokenizing, stops) and then the step to the scheduler, which
records it and ends the sequences that finished. It never sees JSON or protobuf, and
imports TensorFlow only through its runner.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from tokenserve.config import GenerationConfig
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.expert_load import ExpertLoadDelta
from tokenserve.engine.guided import GuidedDecoding
from tokenserve.engine.kv_tier import setup_prefix_cache
from tokenserve.engine.lora_adapter import LoraRequest
from tokenserve.engine.lora_slots import LoraSlots
from tokenserve.engine.output_processor import OutputProcessor
from tokenserve.engine.outputs import ModelRunnerOutput, RequestOutput
from tokenserve.engine.prefix_cache import PrefixCacheStats
from tokenserve.engine.request import Request, SequenceState, check_request
from tokenserve.engine.sampler.draw import SequenceSampler, sample_batch
from tokenserve.engine.scheduler import Scheduler
from tokenserve.engine.scheduler_output import SampledSeq, SchedulerOutput
from tokenserve.engine.spec_decode import SpeculativeDecoding
from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import SamplingParams
from tokenserve.stats import SchedulerStats, StatsSink, StepStats

log = logging.getLogger(__name__)


def _drop_aborted(scheduled: SchedulerOutput, logits: np.ndarray) -> np.ndarray:
    """Drops from `scheduled` the sequences that ended (were aborted) while the step
    computed; returns the rows of `logits` of those left."""
    live = [s for s in scheduled.scheduled if not s.seq.is_finished]
    if len(live) == len(scheduled.scheduled):
        return logits
    rows, first = [], 0
    for item in scheduled.scheduled:
        if not item.seq.is_finished:
            rows.extend(range(first, first + item.num_logits))
        first += item.num_logits
    scheduled.scheduled = live
    return logits[rows]


class LLMEngine:
    """Continuous batching over one model: requests join and leave at every step."""

    def __init__(self, runner, tokenizer, engine_config: EngineConfig = EngineConfig(),
                 stats: StatsSink | None = None, model_name: str | None = None,
                 version: str = ""):
        self.runner, self.tokenizer = runner, tokenizer
        self.config: GenerationConfig = runner.config
        self.engine_config = engine_config
        self.model_name, self.version = model_name or self.config.name, version
        kv_tier = setup_prefix_cache(runner, engine_config, self.model_name, version)
        self.spec_decode = SpeculativeDecoding(engine_config, runner, self.model_name,
                                               self.max_model_len)
        self.speculative = self.spec_decode.enabled
        """Whether decoding sequences draft (num_speculative_tokens, a transformer)."""
        self.scheduler = Scheduler(engine_config, runner.cache, kv_tier,
                                   drafter=self.spec_decode.drafts if self.speculative else None)
        self.output_processor = OutputProcessor(tokenizer, self.config.eos_token_id,
                                                self.max_model_len, stats or StatsSink(),
                                                self.model_name, version)
        self.guided = GuidedDecoding(tokenizer, self.config.model.vocab_size,
                                     self.config.eos_token_id)
        self.loras = (LoraSlots(self.config.model, engine_config.max_loras,
                                engine_config.max_lora_rank, runner.write_lora_slot,
                                runner.prepare_lora_slot, experts=engine_config.lora_experts)
                      if engine_config.max_loras and runner.is_transformer else None)
        """The resident LoRA adapters; None: this engine serves no adapters."""
        if self.loras is not None:  # a request waits until its adapter has a slot
            self.scheduler.can_admit = self.loras.is_ready
        self.num_steps = 0
        self.expert_load = ExpertLoadDelta(getattr(runner, "expert_load", None))

    @property
    def max_model_len(self) -> int:
        cache = self.runner.cache
        # a sequence of an all-windowed model holds at most its window and one chunk
        held = cache.window + self.engine_config.max_num_batched_tokens + 2 * cache.block_size
        if cache.window and cache.capacity_tokens >= held:
            return self.config.max_seq_len
        return min(self.config.max_seq_len, cache.capacity_tokens)

    @property
    def stats(self) -> StatsSink:
        """Where the engine's step, scheduler and request stats go."""
        return self.output_processor.stats

    @stats.setter
    def stats(self, sink: StatsSink) -> None:
        self.output_processor.stats = sink

    @property
    def num_draft_tokens(self) -> int:
        """Drafted tokens checked so far (speculative decoding)."""
        return self.spec_decode.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens the model agreed with so far."""
        return self.spec_decode.num_accepted_tokens

    # -- requests -------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, priority: int = 0,
                     timeout_s: float | None = None, trace_context: dict | None = None,
                     lora: LoraRequest | None = None) -> Request:
        """Validates a request (raising InvalidRequestError / PromptTooLongError, as
        check_request) and gives each of its sequences a sampler, detokenizer and drafter.
        `lora`: the adapter it runs with (an engine with LoRA slots only)."""
        vocab = self.config.model.vocab_size
        if lora is not None and self.loras is None:
            raise InvalidRequestError("this model serves no LoRA adapters (max_loras is 0)")
        check_request(prompt_ids, params, vocab, self.max_model_len, timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params,
                          priority=priority, deadline=deadline, trace_context=trace_context or {},
                          lora=lora)
        for seq in request.seqs:  # an invalid constraint raises here, before taking a slot
            guide = None if params.structured is None else self.guided.make_guide(
                params.structured)
            sampler = SequenceSampler(params, seq.index, vocab, prompt_ids, guide)
            seq.state = SequenceState(sampler, self.output_processor.detokenizer(params),
                                      drafter=self.spec_decode.make_drafter(sampler))
        return request

    def add_request(self, request: Request) -> None:
        """Queues a request made by make_request (QueueFullError when the queue is full)."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add(request)
        if self.loras is not None:
            self.loras.count(request, 0, new_request=True)

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
        return self.output_processor.final(request, [])

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache counters (zeros without prefix caching)."""
        return self.scheduler.prefix_cache_stats()

    def reset_prefix_cache_stats(self) -> None:
        """Zeroes the prefix-cache counters (after warm-up: only users' requests count)."""
        self.scheduler.reset_prefix_cache_stats()

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
        if self.loras is not None:  # slots for the waiting requests' adapters
            waiting = [seq for _, seq in sorted(self.scheduler.waiting)]
            expired += [self._fail_adapter(request, error) for request, error in
                        self.loras.assign(waiting, self.scheduler.running)]
        return [o for o in expired if o is not None], self.scheduler.schedule()

    def _fail_adapter(self, request: Request, error: Exception) -> RequestOutput | None:
        log.warning("request %s aborted: its LoRA adapter %r no longer loads: %s",
                    request.request_id, request.lora.name, error)
        return self.abort(request.request_id)

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
        """Picks and appends the computed sequences' tokens, lets the scheduler record the
        step and end the finished sequences, and emits stats.

        Sequences that finished while the step computed (aborted) are skipped."""
        if not scheduled.scheduled:  # the step only moved KV blocks
            return []
        logits = _drop_aborted(scheduled, output.logits)
        accepted, nonfinite = (self.spec_decode.num_accepted_tokens,
                               self.output_processor.num_nonfinite_logits)
        sampled = self._sample(scheduled, logits)
        self.scheduler.update_from_output(scheduled, sampled, output.duration_s)
        outputs = self.output_processor.make_outputs(sampled)
        if self.loras is not None:
            for took in sampled:
                self.loras.count(took.seq.request, len(took.delta.token_ids), False)
        self._emit_step_stats(scheduled, output.duration_s,
                              self.spec_decode.num_accepted_tokens - accepted,
                              self.output_processor.num_nonfinite_logits - nonfinite)
        self._save_ended()
        return outputs

    def _sample(self, scheduled: SchedulerOutput, logits: np.ndarray) -> list[SampledSeq]:
        """The tokens each sequence takes from the step's logits (float32 [rows, vocab]),
        appended by the output processor: a draw for each sequence that samples (all in
        one batch), then for each drafting one the drafts it keeps and the token after."""
        now = time.time()
        sampling, rows, drafting, row = [], [], [], 0
        for item in scheduled.scheduled:
            row += item.num_logits
            if item.draft_ids:
                drafting.append((item, row - item.num_logits))
            elif item.samples:  # (num_pending_tokens is 0 after this step; the runner asks)
                sampling.append(item.seq)
                rows.append(row - 1)
        sampled, outputs = [], self.output_processor
        if sampling:
            samplers = [seq.state.sampler for seq in sampling]
            tokens, broken = sample_batch(self.guided.mask(logits[rows], samplers), samplers)
            for seq, token, bad in zip(sampling, tokens, broken):
                if bad:
                    outputs.report_nonfinite(seq, token)
            sampled = [SampledSeq(seq, outputs.append(seq, token, logits[row], now))
                       for seq, row, token in zip(sampling, rows, tokens)]
        for item, first in drafting:
            sampled.append(self.spec_decode.accept(
                item, logits[first:first + item.num_logits], outputs, now))
        return sampled

    def _save_ended(self) -> None:
        """Sends the last full blocks of sequences that just ended to the remote tier now,
        before their last output goes out (not before the next step): a next turn sent at
        once to another replica then finds them."""
        tier = self.scheduler.kv_tier
        if tier is not None:
            transfers = self.scheduler.take_transfers()
            if transfers:
                tier.apply(self.runner, transfers)

    def _emit_step_stats(self, scheduled: SchedulerOutput, duration: float,
                         num_accepted: int, num_nonfinite: int) -> None:
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
            num_accepted_tokens=num_accepted, num_nonfinite_logits=num_nonfinite,
            expert_tokens=self.expert_load.take()))
