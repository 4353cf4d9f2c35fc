"""A mixture of experts in the engine: a prompt's greedy tokens are the same whatever else is
in the batch, on each path of the step (the grouped-experts op, the stock-TF grouping after
the fused dense ops, the graph path), and prefix caching and preemption leave them unchanged.
(Parity with transformers: tests/model/test_moe_import.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from support.moe_checkpoints import greedy, moe_engine
from tokenserve.config import GenerationConfig, llama_config
from tokenserve.kernels import moe as kmoe
from tokenserve.kernels.build import KERNELS_ENV

PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 304, 8]]
OTHERS = [[9] * 13, [100, 200, 300, 50, 60], [7, 8], list(range(20, 41))]
SHARED = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]  # three blocks of 4


@pytest.fixture(scope="module")
def moe(tokenizer):
    """(model, tokenizer, generation config): a random Qwen2-MoE-shaped model built by our
    code (8 experts, top-2, a shared expert), weights at std 0.1 so no two logits tie."""
    from tokenserve.model import build_model

    architecture = dataclasses.replace(
        llama_config(vocab_size=400, max_seq_len=256, hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, intermediate_size=48),
        num_experts=8, num_experts_per_token=2, shared_expert_size=32,
        normalize_expert_weights=False)
    model = build_model(architecture, seed=1)
    for weight in model.weights:
        if "norm" not in weight.path:
            weight.assign(weight * 5.0)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="tiny-moe")
    return model, tokenizer, config


PATHS = {"op": {}, "stock-tf-grouping": {kmoe.LIBRARY.mode_env: "fallback"},
         "graph": {KERNELS_ENV: "fallback"}}


@pytest.mark.slow  # three engines; the other MoE engine tests run each path once
def test_tokens_are_the_same_whatever_else_is_in_the_batch_on_every_path(moe, monkeypatch):
    expected = None
    for path, env in PATHS.items():
        for name in (kmoe.LIBRARY.mode_env, KERNELS_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        engine = moe_engine(*moe)
        step = engine.runner.step
        assert step.fused_every_step == (path != "graph") and not step.jit_dense
        alone = [greedy(engine, [p], 10)[0] for p in PROMPTS]
        mixed = greedy(engine, PROMPTS + OTHERS, 10)  # prefill chunks beside decode rows
        assert mixed[:len(PROMPTS)] == alone, path
        expected = expected or alone
        assert alone == expected, path  # and every path gives the op's tokens


def test_prefix_cache_hits_and_preemption_leave_the_tokens_unchanged(moe):
    prompts = [SHARED + [3, 4, 5], SHARED + [6, 7], SHARED + [8, 9, 10, 12]]
    cold = greedy(moe_engine(*moe), prompts, 20)
    warm = moe_engine(*moe, enable_prefix_caching=True)
    assert greedy(warm, prompts[:1], 20) == cold[:1]
    assert greedy(warm, prompts, 20) == cold
    assert warm.prefix_cache_stats().num_hit_tokens >= 12 + 2 * 12
    tight = moe_engine(*moe, max_cache_tokens=64)  # 3 x (15 + 20) tokens do not fit
    assert greedy(tight, prompts, 20) == cold
    assert tight.scheduler.num_preemptions > 0


def test_each_step_reports_its_expert_load_to_the_metrics(moe):
    from prometheus_client import CollectorRegistry

    from tokenserve.observability.llm_metrics import LLMMetrics

    registry = CollectorRegistry()
    engine = moe_engine(*moe)
    engine.stats = LLMMetrics(registry)
    greedy(engine, PROMPTS, 4)
    rows = sum(len(p) for p in PROMPTS) + 3 * len(PROMPTS)  # prompts, then 3 decode steps
    labels = {"model_name": "tiny-moe", "model_version": "", "layer": "1"}
    # two experts a row; each step observes all 8 experts of the layer
    assert registry.get_sample_value("tokenserve:moe_expert_tokens_sum", labels) == 2 * rows
    assert registry.get_sample_value("tokenserve:moe_expert_tokens_count",
                                     labels) == 8 * engine.num_steps


@pytest.mark.slow  # 13 s; the int8 op itself is covered by the kernel tests
def test_int8_experts_through_the_engine_equal_the_int8_models_full_forward_passes(moe):
    from support.tiny_models import greedy_by_full_forward
    from tokenserve.model.quantize import quantize_model

    model, tokenizer, config = moe
    quantized = quantize_model(model)
    weights = quantized.blocks[0].mlp.weights_dict()
    assert "q" in weights["experts"][3]["up"] and "kernel" in weights["router"]
    int8_config = dataclasses.replace(config, model=quantized.config)
    got = greedy(moe_engine(quantized, tokenizer, int8_config), PROMPTS[1:2], 6)
    assert got == [greedy_by_full_forward(quantized, PROMPTS[1], 6)]


def test_pruning_and_tflite_refuse_a_mixture_of_experts_by_name(moe, tmp_path):
    import numpy as np

    from tokenserve.edge.convert import export_tflite
    from tokenserve.errors import ConfigError
    from tokenserve.model.prune import PruneConfig, prune_model

    model, tokenizer, config = moe
    with pytest.raises(ConfigError, match="pruning a mixture of experts is not supported"):
        prune_model(model, np.zeros([1, 8], np.int32), PruneConfig(mlp=0.25))
    with pytest.raises(ConfigError, match="TFLite export of a mixture of experts"):
        export_tflite(model, tokenizer, config, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("weight_format", ["float", "int8"])
def test_qk_norm_experts_take_the_fused_ops_and_match_full_forward_passes(moe, weight_format):
    """A Qwen3-MoE-shaped model (QK-norm, heads 24 wide, renormalised top-2, no shared
    expert): the fused dense ops carry QK-norm, so its steps run them around the MoE op,
    and its tokens are still those of full forward passes, alone or in a batch."""
    from support.tiny_models import greedy_by_full_forward
    from tokenserve.model import build_model
    from tokenserve.model.quantize import quantize_model

    _, tokenizer, config = moe
    architecture = dataclasses.replace(
        config.model, qk_norm=True, head_dim=24, shared_expert_size=0,
        normalize_expert_weights=True)
    model = build_model(architecture, seed=2)
    for weight in model.weights:
        if "norm" not in weight.path:
            weight.assign(weight * 5.0)
    if weight_format == "int8":
        model = quantize_model(model)
    qwen3 = dataclasses.replace(config, model=model.config)
    engine = moe_engine(model, tokenizer, qwen3)
    assert engine.runner.step.fused_blocks is not None
    alone = [greedy(engine, [p], 8)[0] for p in PROMPTS]
    assert greedy(engine, PROMPTS + OTHERS, 8)[:len(PROMPTS)] == alone
    assert alone == [greedy_by_full_forward(model, p, 8) for p in PROMPTS]
