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


def check_batch_matches_references(engine, made, reference_greedy) -> list:
    """The base and every adapter of `made` (a LoRA checkpoint: hf_model, adapters as (path,
    transformers + peft model)) in one batch: each job's greedy tokens are its reference's
    (`reference_greedy(model, prompt, max_tokens)`), and in one step that carries rows of
    every adapter and of the base, each row's logits are within 1e-4 of its reference's.
    Returns the jobs' adapters: None (the base), then one LoraRequest per adapter."""
    import torch

    loras = [None] + [LoraRequest.new(f"a{i}", path) for i, (path, _) in
                      enumerate(made.adapters)]
    references = [made.hf_model] + [model for _, model in made.adapters]
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    for (prompt, lora), tokens in zip(jobs, run(engine, jobs)):
        reference = references[loras.index(lora)]
        assert tokens == reference_greedy(reference, prompt, MAX_TOKENS), (lora, prompt)
    logits = first_logits(engine, [(PROMPTS[0], lora) for lora in loras])
    for row, reference in zip(logits, references):
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPTS[0]])).logits[0, -1].numpy()
        np.testing.assert_allclose(row, expected, atol=1e-4, rtol=0)
    return loras
