"""Warm-up: the step graphs a server's first requests need, traced and run once before the
engine takes requests, so no user pays a trace in their time to first token."""

from __future__ import annotations

import logging
import time

from tokenserve.engine.core import LLMEngine
from tokenserve.errors import QueueFullError
from tokenserve.sampling import SamplingParams
from tokenserve.stats import StatsSink

log = logging.getLogger("tokenserve.engine.async_engine")  # where operators read its lines
_SHORT_WARMUP_PROMPT = 3  # tokens of a warm-up prompt that is not meant to be long


def warm_up(engine: LLMEngine) -> None:
    """Traces the step graphs a server's first requests need and runs each once.

    Two requests: one prompt alone (an idle server's first request), then a second
    prompt while the first decodes (a request arriving during another's answer). Where
    float32 steps above `max_fused_dense_tokens` tokens run XLA's dense programs, the
    prompts are one token longer than that, as most prompts are: a step variant first
    met by a user costs that request its trace (0.5 s for GPT-2-small's 32-token prompt
    on a 2-core VM, measured as its TTFT), and a third, short prompt then runs alone,
    as a short question or a prompt whose prefix is cached does (its first one had
    cost 0.8 s of TTFT against 0.06 s after), joined by a fourth while it decodes.
    Their blocks stay out of the remote KV tier and are forgotten afterwards, and their
    stats go nowhere, so metrics count only users' requests (as in TF Serving, where
    warmup records never reach the request counters)."""
    started = time.perf_counter()
    num_compiled = engine.runner.compile_buckets()
    if num_compiled:
        log.info("compiled %d XLA step shapes in %.2fs", num_compiled,
                 time.perf_counter() - started)
    length = _warmup_prompt_len(engine)
    bos, vocab = engine.config.bos_token_id, engine.config.model.vocab_size

    def requests(lora=None):  # (lora: on the first of each pair)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 2, 2, 1)]
        pairs = [(engine.make_request([bos] * length, params[0], "warmup", lora=lora),
                  engine.make_request([(bos + 1) % vocab] * length, params[1], "warmup-2"))]
        # prompts the fused ops take: one alone, then one joining it while it decodes (a
        # short question arriving while others stream), each a step of its own kind
        if length > _SHORT_WARMUP_PROMPT:
            pairs.append(tuple(engine.make_request(
                [(bos + 2 + i) % vocab] * _SHORT_WARMUP_PROMPT, params[2 + i],
                f"warmup-{3 + i}", lora=None if i else lora) for i in range(2)))
        return pairs
    scheduler = engine.scheduler
    stats, engine.stats = engine.stats, StatsSink()
    tier, scheduler.kv_tier = scheduler.kv_tier, None
    try:
        for pair in requests():
            _run_alone_then_joined(engine, *pair)
        if engine.loras is not None:  # the adapter steps' kinds, on a zero adapter (and on
            # a mixture of experts, those of adapters of its router, and of its experts)
            for role in ("", "router", "expert_down") if engine.loras.serves_experts else ("",):
                zero = engine.loras.warmup_adapter(role)
                for pair in requests(zero):
                    _run_alone_then_joined(engine, *pair)
                engine.loras.forget(zero)
        engine.runner.warm_up_heads()  # the heads greedy requests did not run
    finally:
        scheduler.kv_tier = tier
        engine.stats = stats
        scheduler.cache.reset_prefix_cache()
        engine.reset_prefix_cache_stats()
    log.info("engine warmed up in %.2fs (prompts of %d tokens)",
             time.perf_counter() - started, length)


def _run_alone_then_joined(engine: LLMEngine, first, second) -> None:
    """Steps `first` alone once, adds `second` while it decodes, runs both to the end."""
    engine.add_request(first)
    engine.step()
    try:
        engine.add_request(second)
    except QueueFullError:  # a queue limit below two prompts: the first one only
        pass
    while engine.has_work:
        engine.step()


def _warmup_prompt_len(engine: LLMEngine) -> int:
    """3 tokens, or one more than the fused dense ops take where larger steps run another
    path (XLA for float32, oneDNN for bfloat16);
    at most what the queue admits (`max_queue_tokens`)."""
    runner, engine_config = engine.runner, engine.engine_config
    fused = getattr(runner, "max_fused_dense_tokens", 0)  # transformers only
    length = _SHORT_WARMUP_PROMPT
    if fused:  # larger steps run another path (XLA, or oneDNN for bfloat16)
        longest = min(fused + 1, engine_config.max_num_batched_tokens,
                      engine.max_model_len - 3)
        length = max(_SHORT_WARMUP_PROMPT, longest)
    return min(length, engine_config.max_queue_tokens)  # the queue must take it
