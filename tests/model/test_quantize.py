"""int8 weights: close logits, the perplexity gate, portable exports, and the engine on them."""

from __future__ import annotations

import numpy as np
import pytest

from support.saved_model_ops import assert_stock_tensorflow_graph
from support.tiny_models import greedy_by_full_forward, tiny
from tokenserve.errors import ConfigError
from tokenserve.model.quantize import quantize_model

PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def", "x"]


def quantized(name, tokenizer):
    import dataclasses

    model, config = tiny(name, tokenizer)
    int8 = quantize_model(model)
    return model, int8, dataclasses.replace(config, model=int8.config)


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def int8_export(request, tokenizer, tmp_path_factory):
    """(float model, int8 model, version dir of the int8 export)."""
    from tokenserve.export.exporter import export_model

    model, int8, config = quantized(request.param, tokenizer)
    base = tmp_path_factory.mktemp(f"{request.param}-int8")
    return model, int8, export_model(int8, tokenizer, config, base)


def test_weights_are_int8_with_a_scale_per_output_channel(int8_export):
    _, int8, _ = int8_export
    qkv = int8.blocks[0].attn.qkv
    assert qkv.kernel_q.dtype == "int8" and qkv.kernel_scale.shape == (qkv.units, 1)
    float_params = sum(int(np.prod(w.shape)) for w in int8.weights if w.dtype != "int8")
    int8_params = sum(int(np.prod(w.shape)) for w in int8.weights if w.dtype == "int8")
    assert int8_params > 4 * float_params  # the big matrices are all int8


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_int8_logits_stay_close_to_float32(name, tokenizer):
    model, int8, _ = quantized(name, tokenizer)
    ids = np.asarray([tokenizer.encode(PROMPTS[0] + " " + PROMPTS[2])], np.int32)
    reference, logits = model(ids).numpy(), int8(ids).numpy()
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error < 0.05, error
    # and not trivially: the int8 model really differs from float32
    assert np.abs(logits - reference).max() > 0


def test_perplexity_gate_on_the_built_in_transformer():
    """int8 must cost under +1 % perplexity on the held-out split (llama.cpp's q8_0: ~0.1 %)."""
    from tokenserve.model.checkpoint import load_source
    from tokenserve.tools.evaluate import heldout_windows, perplexity

    model, tokenizer, _ = load_source("builtin")
    windows = heldout_windows(tokenizer, 512, 8192)
    result = perplexity(quantize_model(model), windows, reference=model)
    assert result.num_tokens >= 8000
    assert result.delta_percent < 1.0, result
    assert result.greedy_agreement > 0.95, result


def test_the_export_uses_only_stock_tensorflow_ops_and_matches_the_portable_model(
        int8_export, tokenizer):
    from tokenserve.model.layers import portable_graphs
    from tokenserve.sampling import SamplingParams
    from tokenserve.tools.generate import ExportedModel

    _, int8, version_dir = int8_export
    assert_stock_tensorflow_graph(version_dir)
    exported = ExportedModel(version_dir)
    ids = tokenizer.encode(PROMPTS[0])
    with portable_graphs():
        expected = greedy_by_full_forward(int8, ids, 12)
    assert list(exported.stream(ids, SamplingParams(max_tokens=12, ignore_eos=True))) == expected


def test_the_engine_serves_int8_with_its_kernel_and_equals_full_forward_passes(int8_export):
    from tokenserve.engine.llm import LLM
    from tokenserve.sampling import SamplingParams

    _, int8, version_dir = int8_export
    llm = LLM(version_dir, max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    runner = llm.engine.runner
    assert runner.model.config.weight_format == "int8" and runner.precision == "float32"
    assert not runner.step.jit_dense  # the int8 op is not an XLA op
    # every step runs the fused norm and epilogue ops around the int8 matmuls
    assert runner.step.kernel_dense and runner.step.fused_every_step
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    assert all(fused for _, _, fused in runner.step._steps)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == greedy_by_full_forward(int8, llm.tokenizer.encode(prompt), 10)


def test_only_transformers_quantize(tokenizer):
    model, _ = tiny("tiny-lstm", tokenizer)
    with pytest.raises(ConfigError, match="Transformer"):
        quantize_model(model)
