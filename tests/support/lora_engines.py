"""Engines with LoRA slots on a loaded model, and the greedy runs and first-step logits the
LoRA tests compare with transformers + peft. No tests here."""

from __future__ import annotations

import numpy as np

from tokenserve.engine.config import EngineConfig
from tokenserve.engine.lora_adapter import LoraRequest
from tokenserve.sampling import SamplingParams

PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 304]]
MAX_TOKENS = 6


def make_engine(loaded, **options):
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner

    model, tokenizer, config = loaded
    knobs = dict(max_num_seqs=8, max_num_batched_tokens=48, block_size=4, precision="float32",
                 max_fused_dense_tokens=4, max_loras=3, max_lora_rank=8,
                 # exact logits: float32 KV rows, and no screened (approximate) LM head
                 kv_cache_dtype="float32", max_screened_head_rows=0)
    engine_config = EngineConfig(**{**knobs, **options})
    return LLMEngine(ModelRunner(model, config, engine_config), tokenizer, engine_config)


def run(engine, jobs: list[tuple[list[int], LoraRequest | None]]) -> list[list[int]]:
    """Greedy tokens of every (prompt, adapter) job, all queued at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.make_request(prompt, params, lora=lora) for prompt, lora in jobs]
    for request in requests:
        engine.add_request(request)
    while engine.has_work:
        engine.step()
    return [request.seqs[0].output_ids for request in requests]


def first_logits(engine, jobs) -> np.ndarray:
    """The logits each job samples its first token from, all in one step."""
    recorded = []
    execute = engine.runner.execute
    engine.runner.execute = lambda out: recorded.append(execute(out)) or recorded[-1]
    try:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for prompt, lora in jobs:
            engine.add_request(engine.make_request(prompt, params, lora=lora))
        engine.step()
        while engine.has_work:
            engine.step()
    finally:
        engine.runner.execute = execute
    return recorded[0]
