"""LoRA adapters in the engine: rows of different adapters and of the base in one step each
get what transformers + peft give them alone; slots are shared in LRU order; the prefix
cache never shares blocks across adapters."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from support.lora_engines import (MAX_TOKENS, PROMPTS, check_batch_matches_references,
                                  make_engine, run)
from support.lora_models import lora_checkpoint, reference_greedy
from support.tiny_models import greedy_by_full_forward
from tokenserve.engine.lora_adapter import LoraRequest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

# Llama by default; GPT-2 (fused c_attn, Conv1D layout), Qwen2 (q/v/down only, biases),
# Qwen3 (QK-norm), Gemma 3 (QK-norm, post-norms, GeGLU, windows; graph steps), Mistral
# (windows), Gemma 2 (post-norms, softcaps) and Phi-3 (fused qkv_proj and gate_up_proj,
# a partial rotary) with -m slow: each family's engines trace their own steps, about 30 s
# a family here
@pytest.fixture(scope="module", params=[
    "llama", *(pytest.param(f, marks=pytest.mark.slow) for f in (
        "gpt2", "qwen2", "qwen3", "gemma3", "mistral", "gemma2", "phi3"))])
def checkpoint(request, tokenizer, tmp_path_factory):
    from tokenserve.model.hf import load_hf

    made = lora_checkpoint(request.param, tokenizer, tmp_path_factory.mktemp(request.param))
    return made, load_hf(made.directory)


def test_a_batch_of_three_adapters_and_the_base_matches_peft(checkpoint):
    made, loaded = checkpoint
    engine = make_engine(loaded)
    check_batch_matches_references(engine, made, reference_greedy)


def test_prompt_logits_on_an_adapter_match_peft(checkpoint):
    """The full pass behind echo + logprobs, with an adapter's deltas: peft's logits at
    every prompt position (and the base's without one)."""
    made, loaded = checkpoint
    engine = make_engine(loaded)
    path, reference = made.adapters[0]
    layers = engine.loras.weights_of(LoraRequest.new("a0", path)).layers
    for model, adapter in ((reference, layers), (made.hf_model, None)):
        with torch.no_grad():
            expected = model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
        got = engine.runner.prompt_logits(PROMPTS[0], adapter)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_graph_steps_match_fused_steps(checkpoint):
    """Steps through the plain TF ops (no fused dense ops) give the same tokens."""
    made, loaded = checkpoint
    loras = [None, LoraRequest.new("a0", made.adapters[0][0])]
    jobs = [(PROMPTS[0], lora) for lora in loras] + [(PROMPTS[1], loras[1])]
    assert (run(make_engine(loaded, max_fused_dense_tokens=0), jobs)
            == run(make_engine(loaded), jobs))


def test_more_adapters_than_slots_take_turns(checkpoint):
    made, loaded = checkpoint
    engine = make_engine(loaded, max_loras=1)
    loras = [LoraRequest.new(f"a{i}", path) for i, (path, _) in enumerate(made.adapters)]
    jobs = [(PROMPTS[1], lora) for lora in loras] + [(PROMPTS[1], None)]
    alone = [reference_greedy(model, PROMPTS[1], MAX_TOKENS) for _, model in made.adapters]
    assert run(engine, jobs) == alone + [reference_greedy(made.hf_model, PROMPTS[1],
                                                          MAX_TOKENS)]
    assert engine.loras.num_slot_loads == 3
    # per-adapter counts: one request and its tokens each
    assert {name: (c.num_requests, c.num_generated_tokens)
            for name, c in engine.loras.counts.items()} == {
        f"a{i}": (1, MAX_TOKENS) for i in range(3)}


def test_the_prefix_cache_keys_on_the_adapter(checkpoint):
    made, loaded = checkpoint
    if made.family != "llama":
        pytest.skip("one family is enough: the cache is the same for all")
    engine = make_engine(loaded, enable_prefix_caching=True)
    lora = LoraRequest.new("a0", made.adapters[0][0])
    prompt = PROMPTS[0]
    adapted = run(engine, [(prompt, lora)])
    hits = engine.prefix_cache_stats().num_hit_tokens
    assert run(engine, [(prompt, None)]) == [reference_greedy(made.hf_model, prompt,
                                                              MAX_TOKENS)]
    assert engine.prefix_cache_stats().num_hit_tokens == hits  # none of the adapter's blocks
    assert run(engine, [(prompt, lora)]) == adapted
    assert engine.prefix_cache_stats().num_hit_tokens > hits  # its own blocks, again


@pytest.mark.slow
def test_an_adapter_row_equals_the_merged_model(checkpoint, tmp_path):
    """Cached decode with the adapter as a delta = full forward passes of the model with the
    adapter merged into its weights (peft's merge_and_unload, imported)."""
    from tokenserve.model.hf import load_hf

    made, loaded = checkpoint
    if made.family != "gpt2":
        pytest.skip("one family is enough: the others are held to peft above")
    path, peft_model = made.adapters[0]
    merged = copy.deepcopy(peft_model).merge_and_unload()  # the fixture's stays adapted
    merged.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.json").write_bytes((made.directory / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes(
        (made.directory / "tokenizer_config.json").read_bytes())
    merged_model = load_hf(tmp_path)[0]
    engine = make_engine(loaded)
    got = run(engine, [(PROMPTS[0], LoraRequest.new("a0", path))])
    assert got == [greedy_by_full_forward(merged_model, PROMPTS[0], MAX_TOKENS)]
