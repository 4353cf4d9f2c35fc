"""RoPE with per-pair frequency divisors (TransformerConfig.rope_freq_factors, Llama 3.1+'s
scaling) on every path that computes rotary angles: the model's full forward pass, the
export (config JSON round trip and its signatures), the engine's step, and LiteRT.

The imports that produce such configs are checked against transformers in test_hf_import.py
and test_gguf.py; here the paths are checked against each other, and against a model with
the same weights and no divisors, which must differ (or a path that dropped them would pass).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support.tiny_models import greedy_by_full_forward, tiny
from tokenserve.config import ConfigError, GenerationConfig, preset
from tokenserve.sampling import SamplingParams

# head_dim 16: eight pairs, kept, blended and slowed as Llama 3's table does at long context
FACTORS = (1.0, 1.0, 1.7, 3.2, 8.0, 8.0, 8.0, 8.0)
PROMPT = [5, 17, 33, 90, 140, 7, 8, 9, 250, 3, 44, 61, 77, 12, 300, 301, 302, 40, 41, 42]


@pytest.fixture(scope="module")
def scaled(tokenizer):
    """(model with FACTORS, the same weights without them, generation config)."""
    from tokenserve.model import build_model

    model, plain_config = tiny("tiny-llama", tokenizer)
    # q and k 4x larger: the random model's attention is then sharp enough for positions,
    # and so the rotary angles, to move the logits well past the tolerances below
    model.set_weights([w * 4.0 if "qkv" in v.path else w
                       for v, w in zip(model.weights, model.get_weights())])
    architecture = dataclasses.replace(preset("tiny-llama"), rope_freq_factors=FACTORS)
    config = dataclasses.replace(plain_config, model=architecture)
    scaled_model = build_model(architecture, seed=0)
    scaled_model.set_weights(model.get_weights())
    return scaled_model, model, config


def test_the_divisors_change_the_model(scaled):
    model, plain, _ = scaled
    ids = np.array([PROMPT], np.int32)
    assert np.abs(model(ids).numpy() - plain(ids).numpy()).max() > 1e-2


def test_cached_step_equals_full_forward(scaled):
    model, _, _ = scaled
    state = model.init_state(1, 64)
    logits, state = model.step(np.array([PROMPT[:12]], np.int32), state,
                               np.zeros(1, np.int32), np.array([12], np.int32))
    for position in range(12, len(PROMPT)):
        logits, state = model.step(np.array([[PROMPT[position]]], np.int32), state,
                                   np.array([position], np.int32), np.ones(1, np.int32))
    full = model(np.array([PROMPT], np.int32)).numpy()[0, -1]
    np.testing.assert_allclose(logits.numpy()[0], full, atol=1e-4, rtol=0)


def test_export_keeps_the_divisors_and_the_engine_and_signatures_use_them(scaled, tokenizer,
                                                                       tmp_path):
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.llm import LLM
    from tokenserve.export.exporter import export_model
    from tokenserve.tools.generate import ExportedModel

    model, _, config = scaled
    path = export_model(model, tokenizer, config, tmp_path)
    restored = GenerationConfig.from_dict(
        __import__("json").loads((path / "assets" / "generation_config.json").read_text()))
    assert restored.model.rope_freq_factors == FACTORS

    expected = greedy_by_full_forward(model, PROMPT, 24)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    assert list(ExportedModel(path).stream(PROMPT, greedy)) == expected
    llm = LLM(path, EngineConfig(max_num_seqs=4, block_size=4, precision="float32"))
    out = llm.generate([PROMPT], greedy, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == expected


def test_litert_uses_the_divisors(scaled, tokenizer, tmp_path):
    from tokenserve.edge.convert import export_tflite
    from tokenserve.edge.runner import LiteRTModel

    model, _, config = scaled
    lite = LiteRTModel(export_tflite(model, tokenizer, config, tmp_path / "lite"))
    ids = np.array(PROMPT, np.int32)
    np.testing.assert_allclose(lite.logits(ids), model(ids[None]).numpy()[0], atol=2e-4,
                               rtol=1e-3)


@pytest.mark.parametrize("factors, message", [
    ((1.0, 2.0), "rope_freq_factors has 2 entries; head_dim 16 rotates 8 pairs"),
    ((1.0,) * 7 + (0.0,), "rope_freq_factors must be positive and finite"),
    ((1.0,) * 7 + (float("inf"),), "rope_freq_factors must be positive and finite")])
def test_bad_divisors_are_config_errors(factors, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(preset("tiny-llama"), rope_freq_factors=factors)
    with pytest.raises(ConfigError, match="rope_freq_factors need position='rope'"):
        dataclasses.replace(preset("tiny-gpt2"), rope_freq_factors=(1.0,) * 8)
